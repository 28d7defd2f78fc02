"""fabricwatch.v1 wire format. The *_pb2 modules are generated at install time."""
