package broker

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// NonceBytes is the length of the nonce of a fresh request header (the
	// broker accepts 16 to 64 bytes).
	NonceBytes = 16
	// MaxSignatures is the most signatures VerifySignature looks at in one
	// envelope (as the broker's verifier).
	MaxSignatures = 4
	// SeedBytes is the length of an ed25519 secret seed.
	SeedBytes = ed25519.SeedSize
	// PublicKeyBytes is the length of an ed25519 public key.
	PublicKeyBytes = ed25519.PublicKeySize
	// SignatureBytes is the length of an ed25519 signature.
	SignatureBytes = ed25519.SignatureSize
	// MaxKeyFileBytes bounds what LoadKeyFile reads: a hex seed and a newline.
	MaxKeyFileBytes = 4096
	// KeyIDPrefix starts every key id.
	KeyIDPrefix = "ed25519:"
	// keyIDHashBytes is how much of SHA-256(public key) a key id carries.
	keyIDHashBytes = 16
)

// PAE is DSSE v1's pre-authentication encoding:
// "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body, lengths in bytes as
// ASCII decimal. It is what every signature of the protocol covers.
func PAE(payloadType string, payload []byte) []byte {
	out := make([]byte, 0, len(payloadType)+len(payload)+32)
	out = append(out, "DSSEv1 "...)
	out = strconv.AppendInt(out, int64(len(payloadType)), 10)
	out = append(out, ' ')
	out = append(out, payloadType...)
	out = append(out, ' ')
	out = strconv.AppendInt(out, int64(len(payload)), 10)
	out = append(out, ' ')
	return append(out, payload...)
}

// SHA256 returns SHA-256(data) as a slice.
func SHA256(data []byte) []byte {
	sum := sha256.Sum256(data)
	return sum[:]
}

// KeyID is "ed25519:" + lowercase hex of the first 16 bytes of
// SHA-256(public key). It returns "" for a key that is not 32 bytes.
func KeyID(publicKey []byte) string {
	if len(publicKey) != PublicKeyBytes {
		return ""
	}
	return KeyIDPrefix + hex.EncodeToString(SHA256(publicKey)[:keyIDHashBytes])
}

// LineageHash is the intent lineage hash of a tree: SHA-256 of the UTF-8
// bytes of the root's intent.
func LineageHash(intent string) []byte { return SHA256([]byte(intent)) }

// PayloadType is "application/vnd.<full message name>+protobuf", e.g.
// "application/vnd.delegation.broker.v1.Contract+protobuf".
func PayloadType(m proto.Message) string {
	return payloadTypeOf(m.ProtoReflect().Descriptor().FullName())
}

func payloadTypeOf(name protoreflect.FullName) string {
	return "application/vnd." + string(name) + "+protobuf"
}

// NowMs is the current unix time in milliseconds.
func NowMs() int64 { return time.Now().UnixMilli() }

// VerifyPAESignature reports whether signature is a valid ed25519 signature
// by publicKey over PAE(payloadType, payload), under strict verification
// (RFC 8032 §5.1.7 as the broker's ed25519-dalek verify_strict and libsodium
// apply it): the public key and R must be canonical encodings of points that
// are not of small order, S must be below the group order, and the
// cofactorless equation must hold. Malformed input is simply false.
func VerifyPAESignature(payloadType string, payload, signature, publicKey []byte) bool {
	if len(publicKey) != PublicKeyBytes || len(signature) != SignatureBytes {
		return false
	}
	if !strictPoint(publicKey) || !strictPoint(signature[:32]) {
		return false
	}
	// crypto/ed25519 rejects S >= L and checks [S]B - [k]A against R's
	// exact bytes (cofactorless), so a non-canonical R never matches.
	return ed25519.Verify(ed25519.PublicKey(publicKey), PAE(payloadType, payload), signature)
}

// VerifySignature reports whether some signature of the DSSE envelope (at
// most MaxSignatures of them) verifies strictly under publicKey over
// PAE(payload_type, payload). With a non-empty expectedType, the envelope's
// payload type must be it. The keyid hint is ignored.
func VerifySignature(envelope *pb.Envelope, publicKey []byte, expectedType string) bool {
	if envelope == nil || len(envelope.GetSignatures()) > MaxSignatures {
		return false
	}
	if expectedType != "" && envelope.GetPayloadType() != expectedType {
		return false
	}
	for _, s := range envelope.GetSignatures() {
		if VerifyPAESignature(envelope.GetPayloadType(), envelope.GetPayload(), s.GetSig(), publicKey) {
			return true
		}
	}
	return false
}

// Agent is an agent's (or an attestor's, or a host's) ed25519 key pair. It
// signs requests; it is safe for concurrent use.
type Agent struct {
	private   ed25519.PrivateKey
	publicKey []byte
	keyID     string
}

// GenerateAgent makes a fresh key from crypto/rand.
func GenerateAgent() (*Agent, error) {
	seed := make([]byte, SeedBytes)
	if _, err := rand.Read(seed); err != nil {
		return nil, fmt.Errorf("broker: reading random bytes: %w", err)
	}
	return AgentFromSeed(seed)
}

// AgentFromSeed is the key whose 32-byte secret seed is seed.
func AgentFromSeed(seed []byte) (*Agent, error) {
	if len(seed) != SeedBytes {
		return nil, fmt.Errorf("broker: an ed25519 seed is %d bytes, got %d", SeedBytes, len(seed))
	}
	private := ed25519.NewKeyFromSeed(seed)
	public := []byte(private.Public().(ed25519.PublicKey))
	return &Agent{private: private, publicKey: public, keyID: KeyID(public)}, nil
}

// LoadKeyFile reads a key file as `delegation-broker keygen --out FILE`
// writes it: the secret seed in hex, one line. Like the broker's own
// commands it refuses a file its group or others may read.
func LoadKeyFile(path string) (*Agent, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("broker: key file: %w", err)
	}
	if info.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("broker: key file %s is readable by others (mode %#o): chmod 600 it", path, info.Mode().Perm())
	}
	if info.Size() > MaxKeyFileBytes {
		return nil, fmt.Errorf("broker: key file %s is %d bytes, more than a key file (%d at most)", path, info.Size(), MaxKeyFileBytes)
	}
	text, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("broker: key file: %w", err)
	}
	seed, err := hex.DecodeString(strings.TrimSpace(string(text)))
	if err != nil || len(seed) != SeedBytes {
		return nil, fmt.Errorf("broker: key file %s does not hold a %d-byte seed in hex", path, SeedBytes)
	}
	return AgentFromSeed(seed)
}

// PublicKey is the 32-byte ed25519 public key.
func (a *Agent) PublicKey() []byte { return append([]byte(nil), a.publicKey...) }

// KeyID is the key's id ("ed25519:" + 32 hex digits).
func (a *Agent) KeyID() string { return a.keyID }

// Seed is the 32-byte secret seed. Keep it secret.
func (a *Agent) Seed() []byte { return append([]byte(nil), a.private.Seed()...) }

func (a *Agent) String() string { return "Agent(" + a.keyID + ")" }

// Header is a request header with the current time and a fresh random nonce.
// The nonce is the idempotency key: to retry, resend the request signed over
// this header unchanged, never a re-signed one.
func (a *Agent) Header() (*pb.RequestHeader, error) {
	nonce := make([]byte, NonceBytes)
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("broker: reading random bytes: %w", err)
	}
	return &pb.RequestHeader{AgentPublicKey: a.PublicKey(), TimestampMs: NowMs(), Nonce: nonce}, nil
}

// SignRaw is the raw ed25519 signature of message.
func (a *Agent) SignRaw(message []byte) []byte { return ed25519.Sign(a.private, message) }

// SignBytes is a one-signature DSSE envelope over payload as given.
func (a *Agent) SignBytes(payloadType string, payload []byte) *pb.Envelope {
	return &pb.Envelope{
		PayloadType: payloadType,
		Payload:     append([]byte(nil), payload...),
		Signatures:  []*pb.Signature{{Keyid: a.keyID, Sig: a.SignRaw(PAE(payloadType, payload))}},
	}
}

// Sign is a one-signature DSSE envelope over m's serialized bytes (payload
// type PayloadType(m)), e.g. an Attestation.
func (a *Agent) Sign(m proto.Message) (*pb.Envelope, error) {
	payload, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("broker: encoding %s: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	return a.SignBytes(PayloadType(m), payload), nil
}

// SignRequest signs any request body: a <Name>Body message in,
// <Name>Request{signed: envelope over the body} out, with payload type
// "application/vnd.delegation.broker.v1.<Name>Body+protobuf". A body without
// a header gets a fresh one (Header); body itself is not modified.
func (a *Agent) SignRequest(body proto.Message) (proto.Message, error) {
	desc := body.ProtoReflect().Descriptor()
	name := string(desc.FullName())
	headerField := desc.Fields().ByName("header")
	if !strings.HasSuffix(name, "Body") || headerField == nil || headerField.Message() == nil ||
		headerField.Message().FullName() != "delegation.broker.v1.RequestHeader" {
		return nil, fmt.Errorf("broker: %s is not a signed request body", name)
	}
	requestType, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(strings.TrimSuffix(name, "Body") + "Request"))
	if err != nil {
		return nil, fmt.Errorf("broker: %s is not a signed request body", name)
	}
	signedField := requestType.Descriptor().Fields().ByName("signed")
	if signedField == nil {
		return nil, fmt.Errorf("broker: %s is not a signed request body", name)
	}
	filled := proto.Clone(body)
	if !filled.ProtoReflect().Has(headerField) {
		header, err := a.Header()
		if err != nil {
			return nil, err
		}
		filled.ProtoReflect().Set(headerField, protoreflect.ValueOfMessage(header.ProtoReflect()))
	}
	envelope, err := a.Sign(filled)
	if err != nil {
		return nil, err
	}
	request := requestType.New()
	request.Set(signedField, protoreflect.ValueOfMessage(envelope.ProtoReflect()))
	return request.Interface(), nil
}

func signAs[Req proto.Message](a *Agent, body proto.Message) (Req, error) {
	var zero Req
	request, err := a.SignRequest(body)
	if err != nil {
		return zero, err
	}
	typed, ok := request.(Req)
	if !ok {
		return zero, fmt.Errorf("broker: %T does not sign as %T", body, zero)
	}
	return typed, nil
}

// OpenRoot signs an OpenRoot request (a fresh header unless body has one).
func (a *Agent) OpenRoot(body *pb.OpenRootBody) (*pb.OpenRootRequest, error) {
	return signAs[*pb.OpenRootRequest](a, body)
}

// Delegate signs a Delegate request.
func (a *Agent) Delegate(body *pb.DelegateBody) (*pb.DelegateRequest, error) {
	return signAs[*pb.DelegateRequest](a, body)
}

// OpenSession signs an OpenSession request (body.BrokerKeyId: the broker's
// current key id).
func (a *Agent) OpenSession(body *pb.OpenSessionBody) (*pb.OpenSessionRequest, error) {
	return signAs[*pb.OpenSessionRequest](a, body)
}

// Accept signs an Accept request (as the contract's delegate).
func (a *Agent) Accept(body *pb.AcceptBody) (*pb.AcceptRequest, error) {
	return signAs[*pb.AcceptRequest](a, body)
}

// Decline signs a Decline request (as the contract's delegate).
func (a *Agent) Decline(body *pb.DeclineBody) (*pb.DeclineRequest, error) {
	return signAs[*pb.DeclineRequest](a, body)
}

// Complete signs a Complete request (as the contract's delegate).
func (a *Agent) Complete(body *pb.CompleteBody) (*pb.CompleteRequest, error) {
	return signAs[*pb.CompleteRequest](a, body)
}

// Adjudicate signs an Adjudicate request (as the principal).
func (a *Agent) Adjudicate(body *pb.AdjudicateBody) (*pb.AdjudicateRequest, error) {
	return signAs[*pb.AdjudicateRequest](a, body)
}

// Escalate signs an Escalate request (as the contract's delegate).
func (a *Agent) Escalate(body *pb.EscalateBody) (*pb.EscalateRequest, error) {
	return signAs[*pb.EscalateRequest](a, body)
}

// Revoke signs a Revoke request (as the holder of an ancestor).
func (a *Agent) Revoke(body *pb.RevokeBody) (*pb.RevokeRequest, error) {
	return signAs[*pb.RevokeRequest](a, body)
}

// RecordReceipts signs a RecordReceipts request (as the contract's host).
func (a *Agent) RecordReceipts(body *pb.RecordReceiptsBody) (*pb.RecordReceiptsRequest, error) {
	return signAs[*pb.RecordReceiptsRequest](a, body)
}

// Attest is an attestor's envelope vouching for agentPublicKey with trust
// factor in (0, 1] until expiresAtMs (unix ms). The broker must trust this
// key ([trust] attestors in its configuration).
func (a *Agent) Attest(agentPublicKey []byte, factor float64, expiresAtMs int64, riskClass string) (*pb.Envelope, error) {
	return a.Sign(&pb.Attestation{AgentPublicKey: agentPublicKey, Factor: factor, ExpiresAtMs: expiresAtMs, RiskClass: riskClass})
}
