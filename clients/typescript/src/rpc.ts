/**
 * The vendored `google.rpc` messages (Status, ErrorInfo, BadRequest, ...;
 * googleapis, unchanged) the broker's error details are made of.
 */
export * from "./gen/google/rpc/status_pb.js";
export * from "./gen/google/rpc/error_details_pb.js";
export * from "./gen/google/rpc/code_pb.js";
