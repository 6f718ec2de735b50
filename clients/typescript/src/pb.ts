/**
 * Every generated message schema, type and enum of `delegation.broker.v1`
 * and the `Broker` service descriptor, in one namespace (protobuf-es v2:
 * build messages with `create(DelegateBodySchema, {...})`, serialize with
 * `toBinary`, parse with `fromBinary`). The generated files live in
 * `src/gen/` (`buf generate` with the repository's buf.gen.yaml); a test
 * fails when a generated file of the broker's package is not re-exported
 * here.
 */
export * from "./gen/delegation/broker/v1/types_pb.js";
export * from "./gen/delegation/broker/v1/broker_pb.js";
export * from "./gen/delegation/broker/v1/errors_pb.js";
