module github.com/delegation-broker/delegation-broker/clients/go

// The oldest versions this module is built and tested with: Debian 12's
// packages (golang-go 1.19, golang-google-grpc-dev 1.33.3,
// golang-google-protobuf-dev 1.28.1). The generated gRPC stubs need gRPC-Go
// 1.32 or later (grpc.SupportPackageIsVersion7), the generated messages
// protobuf-go 1.20 or later; newer releases of both work.
go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
