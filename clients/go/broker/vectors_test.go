package broker_test

import (
	"bytes"
	"crypto/ed25519"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
	"github.com/delegation-broker/delegation-broker/clients/go/internal/brokertest"
)

type vectorCase struct {
	Name, Form, Message, Seed, Body, PAE, Signature, Signed string
	PayloadType                                             string  `json:"payload_type"`
	PublicKey                                               string  `json:"public_key"`
	KeyID                                                   string  `json:"key_id"`
	ID                                                      *string `json:"id"`
	RequestDigest                                           *string `json:"request_digest"`
	Base                                                    string
}

type vectors struct {
	BrokerKeys []struct {
		KeyID     string `json:"key_id"`
		PublicKey string `json:"public_key"`
		Current   bool
	} `json:"broker_keys"`
	Cases    []vectorCase
	Chain    []string
	Negative []vectorCase
}

func unhex(t *testing.T, s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func loadVectors(t *testing.T) (*vectors, *broker.BrokerKeys) {
	text, err := os.ReadFile(filepath.Join(brokertest.RepoRoot(t), "testdata", "signing-vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v vectors
	if err := json.Unmarshal(text, &v); err != nil {
		t.Fatal(err)
	}
	var keys []*pb.BrokerKey
	for _, k := range v.BrokerKeys {
		keys = append(keys, &pb.BrokerKey{KeyId: k.KeyID, PublicKey: unhex(t, k.PublicKey), Current: k.Current})
	}
	bk, err := broker.NewBrokerKeys(keys)
	if err != nil {
		t.Fatal(err)
	}
	return &v, bk
}

func sealedMessageFor(t *testing.T, payloadType string) interface {
	proto.Message
	GetBrokerKeyId() string
} {
	switch payloadType {
	case broker.ContractType:
		return &pb.Contract{}
	case broker.ReceiptType:
		return &pb.Receipt{}
	case broker.SessionType:
		return &pb.Session{}
	}
	t.Fatalf("%s is not a sealed type", payloadType)
	return nil
}

// The shared signing test vectors (testdata/signing-vectors.json), as the
// Rust, Python and TypeScript tests check them.
func TestSigningVectors(t *testing.T) {
	v, keys := loadVectors(t)
	if len(v.Cases) == 0 || len(v.Negative) == 0 || len(v.Chain) == 0 {
		t.Fatal("the vectors are empty")
	}
	byName := map[string]vectorCase{}
	for _, c := range v.Cases {
		c := c
		byName[c.Name] = c
		t.Run(c.Name, func(t *testing.T) {
			body, sig, pub := unhex(t, c.Body), unhex(t, c.Signature), unhex(t, c.PublicKey)
			agent, err := broker.AgentFromSeed(unhex(t, c.Seed))
			if err != nil {
				t.Fatal(err)
			}
			if hex.EncodeToString(agent.PublicKey()) != c.PublicKey || broker.KeyID(pub) != c.KeyID || agent.KeyID() != c.KeyID {
				t.Fatal("public key or key id")
			}
			mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(c.Message))
			if err != nil {
				t.Fatal(err)
			}
			if broker.PayloadType(mt.New().Interface()) != c.PayloadType {
				t.Fatal("payload type")
			}
			if hex.EncodeToString(broker.PAE(c.PayloadType, body)) != c.PAE {
				t.Fatal("PAE")
			}
			if !broker.VerifyPAESignature(c.PayloadType, body, sig, pub) {
				t.Fatal("the signature does not verify")
			}
			if hex.EncodeToString(agent.SignRaw(broker.PAE(c.PayloadType, body))) != c.Signature {
				t.Fatal("signing again differs")
			}
			m := mt.New().Interface()
			if err := proto.Unmarshal(body, m); err != nil {
				t.Fatal(err)
			}
			again, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
			if err != nil || hex.EncodeToString(again) != c.Body {
				t.Fatal("the body does not re-encode to itself")
			}
			signed := unhex(t, c.Signed)
			if c.Form == "envelope" {
				if c.ID != nil || c.RequestDigest == nil || *c.RequestDigest != hex.EncodeToString(broker.SHA256(unhex(t, c.PAE))) {
					t.Fatal("request digest")
				}
				envelope := &pb.Envelope{}
				if err := proto.Unmarshal(signed, envelope); err != nil {
					t.Fatal(err)
				}
				if !broker.VerifySignature(envelope, pub, c.PayloadType) || envelope.GetSignatures()[0].GetKeyid() != c.KeyID {
					t.Fatal("envelope")
				}
				mine, _ := proto.Marshal(agent.SignBytes(c.PayloadType, body))
				if hex.EncodeToString(mine) != c.Signed {
					t.Fatal("the envelope signed again differs")
				}
				if h := m.ProtoReflect().Get(m.ProtoReflect().Descriptor().Fields().ByName("header")).Message().Interface().(*pb.RequestHeader); !bytes.Equal(h.GetAgentPublicKey(), pub) {
					t.Fatal("a request is signed by its header's agent")
				}
			} else {
				if c.RequestDigest != nil || c.ID == nil || *c.ID != hex.EncodeToString(broker.SHA256(body)) {
					t.Fatal("id")
				}
				sealed := &pb.Sealed{}
				if err := proto.Unmarshal(signed, sealed); err != nil || !bytes.Equal(sealed.GetPayload(), body) || !bytes.Equal(sealed.GetSignature(), sig) {
					t.Fatal("sealed")
				}
				id, err := broker.VerifySealed(sealed, keys, sealedMessageFor(t, c.PayloadType))
				if err != nil || id != c.KeyID {
					t.Fatalf("sealed verification: %v", err)
				}
			}
		})
	}
	t.Run("chain", func(t *testing.T) {
		var chain []*pb.Sealed
		var ids []string
		for _, name := range v.Chain {
			c := byName[name]
			chain = append(chain, &pb.Sealed{Payload: unhex(t, c.Body), Signature: unhex(t, c.Signature)})
			ids = append(ids, *c.ID)
		}
		verified, err := broker.VerifyChain(chain, keys, unhex(t, ids[len(ids)-1]))
		if err != nil {
			t.Fatal(err)
		}
		root, child := verified[0].Contract, verified[1].Contract
		if hex.EncodeToString(root.GetRequestDigest()) != *byName["open-root"].RequestDigest ||
			hex.EncodeToString(child.GetRequestDigest()) != *byName["delegate"].RequestDigest ||
			verified[1].EffectivePredicate != "("+root.GetPredicate()+"\n) && ("+child.GetPredicate()+"\n)" {
			t.Fatal("chain bindings")
		}
		refused := byName["receipt-refused"]
		r, err := broker.VerifyReceipt(&pb.Sealed{Payload: unhex(t, refused.Body), Signature: unhex(t, refused.Signature)}, keys, unhex(t, *refused.ID))
		if err != nil || r.Receipt.GetPrimary() != pb.InvariantCode_INVARIANT_CODE_NO_RETRY_HEADROOM || hex.EncodeToString(r.Receipt.GetContractId()) != ids[0] {
			t.Fatalf("refusal: %v", err)
		}
		leaf := chain[len(chain)-1]
		for i := 0; i < len(leaf.GetPayload()); i += 7 {
			tampered := append([]byte(nil), leaf.GetPayload()...)
			tampered[i] ^= 0x80
			forged := append(append([]*pb.Sealed(nil), chain[:len(chain)-1]...), &pb.Sealed{Payload: tampered, Signature: leaf.GetSignature()})
			if _, err := broker.VerifyChain(forged, keys, nil); err == nil {
				t.Fatalf("byte %d flipped still verifies", i)
			}
		}
	})
	for _, n := range v.Negative {
		n := n
		t.Run("negative/"+n.Name, func(t *testing.T) {
			body, sig, pub := unhex(t, n.Body), unhex(t, n.Signature), unhex(t, n.PublicKey)
			if broker.VerifyPAESignature(n.PayloadType, body, sig, pub) {
				t.Fatal("verifies")
			}
			if n.Form == "envelope" {
				if broker.VerifySignature(&pb.Envelope{PayloadType: n.PayloadType, Payload: body, Signatures: []*pb.Signature{{Sig: sig}}}, pub, "") {
					t.Fatal("envelope verifies")
				}
			} else if _, err := broker.VerifySealed(&pb.Sealed{Payload: body, Signature: sig}, keys, sealedMessageFor(t, n.PayloadType)); err == nil {
				t.Fatal("sealed verifies")
			}
		})
	}
}

// Strict verification refuses what crypto/ed25519 alone accepts: a
// small-order public key with a small-order R (here the identity, S = 0:
// [0]B - [k]A = R for every message), and a non-canonical key encoding.
func TestStrictEd25519(t *testing.T) {
	identity := make([]byte, 32)
	identity[0] = 1
	sig := append(append([]byte(nil), identity...), make([]byte, 32)...)
	t.Logf("crypto/ed25519 alone accepts it: %v", ed25519.Verify(identity, broker.PAE("t", []byte("anything")), sig))
	if broker.VerifyPAESignature("t", []byte("anything"), sig, identity) {
		t.Fatal("a small-order key and R verified")
	}
	agent := brokertest.Agent(t)
	good := agent.SignRaw(broker.PAE("t", []byte("m")))
	if !broker.VerifyPAESignature("t", []byte("m"), good, agent.PublicKey()) {
		t.Fatal("a genuine signature fails")
	}
	// y = p + 1 (non-canonical encoding of the identity's y).
	nonCanonical := []byte{0xee}
	for i := 1; i < 31; i++ {
		nonCanonical = append(nonCanonical, 0xff)
	}
	nonCanonical = append(nonCanonical, 0x7f)
	if broker.VerifyPAESignature("t", []byte("anything"), sig, nonCanonical) {
		t.Fatal("a non-canonical key verified")
	}
}
