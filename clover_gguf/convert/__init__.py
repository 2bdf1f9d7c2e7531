"""HF checkpoint -> GGUF converter (clover-spec section 4): ``clover-gguf convert``."""
