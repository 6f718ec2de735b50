// Package broker is the Go client of the delegation broker: a thin layer over
// the generated gRPC stubs (package brokerv1) that does what is easy to get
// wrong by hand.
//
//   - Agent holds an ed25519 key (LoadKeyFile reads what `delegation-broker
//     keygen` writes) and signs every mutating request as a DSSE envelope over
//     PAE(payload type, body), with a fresh random nonce that is also the
//     request's idempotency key.
//   - Client signs, sends and verifies: a call that fails UNAVAILABLE (or
//     times out) is resent with the very same bytes, so the broker answers
//     it from its request log (replayed) and never reserves twice; reads
//     carry a read session, renewed when the broker no longer takes it.
//   - Every failure is a *BrokerError (use errors.As): the gRPC code, the
//     broker's stable reason and metadata, and for a refused Delegate every
//     violated invariant with its requested and allowed values.
//   - VerifyChain, VerifyContract, VerifyReceipt and VerifySealed verify
//     offline, from GetBrokerKeys alone, as types.proto's "Verifying a chain"
//     says (strict ed25519 verification).
//   - Watch follows a subtree, every event verified, resumable by cursor.
//
// Nothing here holds global state: a Client is built on a grpc.ClientConn you
// dial, and every call takes a context (a call without a deadline gets
// DefaultCallTimeout).
package broker
