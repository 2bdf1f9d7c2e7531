"""Files shipped inside the package. Imports nothing, so every module can use it."""
import os

# the small trained Clover that Model(), Clover() and the CLI use without a model path
# (bench/train/train_tiny.py makes it; docs/model.md)
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "clover-tiny-q8_0.gguf")
