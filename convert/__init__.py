"""HF checkpoint -> GGUF converter and the test-checkpoint generator (clover-spec section 4)."""
