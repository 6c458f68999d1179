"""Edge SDK: profile a device, search and train a model under its budget, export ONNX, write a bundle."""

__version__ = "0.1.0"
