"""Generated protobuf/gRPC code for the rpcdist.v1 wire contract (do not edit; see protos/)."""
