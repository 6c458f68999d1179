"""The wire between edge and server: ONNX export/validation and the bundle format."""
