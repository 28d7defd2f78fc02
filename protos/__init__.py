"""Generated protobuf modules (fabricwatch.v1); see protos/v1/*.proto."""
