module github.com/delegation-broker/delegation-broker/clients/go

// The oldest versions this module is built and tested with: Debian 12's
// packages (golang-go 1.19, golang-google-grpc-dev 1.33.3,
// golang-google-protobuf-dev 1.28.1, golang-github-golang-protobuf-1-5-dev
// 1.5.2). The generated gRPC stubs need gRPC-Go 1.32 or later
// (grpc.SupportPackageIsVersion7), the generated messages protobuf-go 1.20
// or later. gRPC-Go 1.33 encodes messages through github.com/golang/protobuf,
// which must be 1.4 or later (the APIv2 wrapper: 1.3 cannot encode these
// messages), hence its line here. Only these versions are tested.
go 1.19

require (
	github.com/golang/protobuf v1.5.2 // indirect
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
