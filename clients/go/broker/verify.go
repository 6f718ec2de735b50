package broker

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// ContractType is the type a Sealed Contract is signed under.
	ContractType = "application/vnd.delegation.broker.v1.Contract+protobuf"
	// ReceiptType is the type a Sealed Receipt is signed under.
	ReceiptType = "application/vnd.delegation.broker.v1.Receipt+protobuf"
	// SessionType is the type a Sealed Session is signed under.
	SessionType = "application/vnd.delegation.broker.v1.Session+protobuf"
	// MaxChainContracts is the most contracts VerifyChain accepts: the
	// deepest policy the broker allows is 64, so a chain has at most 65.
	MaxChainContracts = 65
	// PPMOne is a trust of 1.0 in parts per million.
	PPMOne = 1_000_000
	// MaxEffectivePredicateBytes is the longest effective predicate the
	// broker issues, in UTF-8 bytes.
	MaxEffectivePredicateBytes = 65_536
	// MaxBrokerKeys bounds how many published keys NewBrokerKeys takes.
	MaxBrokerKeys = 1024
	// maxQuoted bounds how much of an untrusted string an error message quotes.
	maxQuoted = 80
)

// VerificationError says that something the broker signed, or a chain, does
// not verify. Index is the position in the chain (root = 0) of the contract
// at fault, or -1 when the error is not about one contract of a chain.
type VerificationError struct {
	Index  int
	Detail string
}

func (e *VerificationError) Error() string {
	if e.Index >= 0 {
		return fmt.Sprintf("contract %d: %s", e.Index, e.Detail)
	}
	return e.Detail
}

func verr(index int, format string, args ...interface{}) error {
	return &VerificationError{Index: index, Detail: fmt.Sprintf(format, args...)}
}

func quote(s string) string {
	if len(s) > maxQuoted {
		s = s[:maxQuoted]
	}
	return fmt.Sprintf("%q", s)
}

// BrokerKeys are the broker's published verifying keys, by key id. Retired
// keys keep verifying what they signed: keep them all.
type BrokerKeys struct {
	keys    map[string][]byte
	order   []string
	current string
}

// NewBrokerKeys takes GetBrokerKeys' keys. Each must be 32 bytes under the id
// "ed25519:" + hex(SHA-256(key)[0..16]); otherwise it fails (a key under a
// wrong id must vouch for nothing).
func NewBrokerKeys(keys []*pb.BrokerKey) (*BrokerKeys, error) {
	if len(keys) > MaxBrokerKeys {
		return nil, verr(-1, "%d published keys, more than %d", len(keys), MaxBrokerKeys)
	}
	out := &BrokerKeys{keys: map[string][]byte{}}
	for _, k := range keys {
		if len(k.GetPublicKey()) != PublicKeyBytes {
			return nil, verr(-1, "published key %s is %d bytes, not 32", quote(k.GetKeyId()), len(k.GetPublicKey()))
		}
		if k.GetKeyId() != KeyID(k.GetPublicKey()) {
			return nil, verr(-1, "published key id %s does not match its public key", quote(k.GetKeyId()))
		}
		if _, seen := out.keys[k.GetKeyId()]; !seen {
			out.order = append(out.order, k.GetKeyId())
		}
		out.keys[k.GetKeyId()] = append([]byte(nil), k.GetPublicKey()...)
		if k.GetCurrent() {
			out.current = k.GetKeyId()
		}
	}
	if len(out.keys) == 0 {
		return nil, verr(-1, "no broker keys")
	}
	return out, nil
}

// BrokerKeysFromPublicKeys takes raw 32-byte public keys (none current).
func BrokerKeysFromPublicKeys(publicKeys ...[]byte) (*BrokerKeys, error) {
	keys := make([]*pb.BrokerKey, 0, len(publicKeys))
	for _, k := range publicKeys {
		keys = append(keys, &pb.BrokerKey{KeyId: KeyID(k), PublicKey: k})
	}
	return NewBrokerKeys(keys)
}

// FetchBrokerKeys calls GetBrokerKeys (public: no session needed).
func FetchBrokerKeys(ctx context.Context, client pb.BrokerClient) (*BrokerKeys, error) {
	ctx, cancel := withDefaultTimeout(ctx, DefaultCallTimeout)
	defer cancel()
	response, err := client.GetBrokerKeys(ctx, &pb.GetBrokerKeysRequest{})
	if err != nil {
		return nil, AsBrokerError(err)
	}
	return NewBrokerKeys(response.GetKeys())
}

// Get returns the public key under id.
func (k *BrokerKeys) Get(id string) ([]byte, bool) {
	key, ok := k.keys[id]
	return key, ok
}

// Current is the id of the key published as current ("" if none).
func (k *BrokerKeys) Current() string { return k.current }

// IDs lists every key id, in the order published.
func (k *BrokerKeys) IDs() []string { return append([]string(nil), k.order...) }

// PublicKeys lists every public key, in the order published.
func (k *BrokerKeys) PublicKeys() [][]byte {
	out := make([][]byte, 0, len(k.order))
	for _, id := range k.order {
		out = append(out, k.keys[id])
	}
	return out
}

// VerifiedContract is a verified contract: its id, terms and what follows
// from its chain. From VerifyChain every field is proven; from
// VerifyContract on a child, EffectivePredicate and PrincipalPublicKey are
// unknown (HasChain false): they need its ancestors.
type VerifiedContract struct {
	ContractID         []byte
	Contract           *pb.Contract
	KeyID              string
	Sealed             *pb.Sealed
	EffectivePredicate string
	PrincipalPublicKey []byte
	HasChain           bool
}

// VerifiedReceipt is a verified receipt, its id and the key that signed it.
type VerifiedReceipt struct {
	ReceiptID []byte
	Receipt   *pb.Receipt
	KeyID     string
	Sealed    *pb.Sealed
}

// sealedMessage is what the broker seals: each carries broker_key_id.
type sealedMessage interface {
	proto.Message
	GetBrokerKeyId() string
}

func checkSignature(sealed *pb.Sealed, typ, id string, keys *BrokerKeys, index int) error {
	key, ok := keys.Get(id)
	if !ok {
		return verr(index, "signed by %s, which is not a published broker key", quote(id))
	}
	if !VerifyPAESignature(typ, sealed.GetPayload(), sealed.GetSignature(), key) {
		return verr(index, "the signature does not verify under broker key %s", id)
	}
	return nil
}

// VerifySealed verifies a broker-signed Sealed whose message is into's type
// (a *pb.Contract, *pb.Receipt or *pb.Session: the type the field carrying
// it implies), decoding the payload into into. The payload's broker_key_id
// must name a published key and the signature must verify strictly under it
// over PAE("application/vnd.delegation.broker.v1.<Type>+protobuf", payload).
// It returns the key id. Only then are into's fields to be trusted.
func VerifySealed(sealed *pb.Sealed, keys *BrokerKeys, into sealedMessage) (string, error) {
	return verifySealedAt(sealed, keys, into, -1)
}

func verifySealedAt(sealed *pb.Sealed, keys *BrokerKeys, into sealedMessage, index int) (string, error) {
	if sealed == nil {
		return "", verr(index, "no sealed message")
	}
	if err := proto.Unmarshal(sealed.GetPayload(), into); err != nil {
		return "", verr(index, "the payload is not a %s", into.ProtoReflect().Descriptor().FullName())
	}
	id := into.GetBrokerKeyId()
	if err := checkSignature(sealed, PayloadType(into), id, keys, index); err != nil {
		return "", err
	}
	return id, nil
}

// VerifyReceipt verifies a broker-signed Receipt and, when receiptID is not
// nil, that it is SHA-256 of the payload. With a chain verified up to its
// contract_id it proves the event happened to exactly those terms.
func VerifyReceipt(sealed *pb.Sealed, keys *BrokerKeys, receiptID []byte) (*VerifiedReceipt, error) {
	receipt := &pb.Receipt{}
	id, err := VerifySealed(sealed, keys, receipt)
	if err != nil {
		return nil, err
	}
	sum := SHA256(sealed.GetPayload())
	if receiptID != nil && !bytes.Equal(receiptID, sum) {
		return nil, verr(-1, "receipt id %x is not SHA-256(payload) %x", receiptID, sum)
	}
	return &VerifiedReceipt{ReceiptID: sum, Receipt: receipt, KeyID: id, Sealed: sealed}, nil
}

// VerifyContract verifies one contract on its own: its signature and, when
// contractID is not nil, that it is SHA-256 of the payload. A root is
// checked as the one-element chain it is; a child only as far as it can be
// alone (its terms against its ancestors need VerifyChain).
func VerifyContract(sealed *pb.Sealed, keys *BrokerKeys, contractID []byte) (*VerifiedContract, error) {
	if sealed == nil {
		return nil, verr(-1, "no sealed contract")
	}
	decoded := &pb.Contract{}
	if err := proto.Unmarshal(sealed.GetPayload(), decoded); err != nil {
		return nil, verr(-1, "the payload is not a delegation.broker.v1.Contract")
	}
	if len(decoded.GetParentId()) == 0 && decoded.GetDepth() == 0 {
		chain, err := VerifyChain([]*pb.Sealed{sealed}, keys, contractID)
		if err != nil {
			return nil, err
		}
		return chain[0], nil
	}
	contract := &pb.Contract{}
	id, err := VerifySealed(sealed, keys, contract)
	if err != nil {
		return nil, err
	}
	sum := SHA256(sealed.GetPayload())
	if contractID != nil && !bytes.Equal(contractID, sum) {
		return nil, verr(-1, "contract id %x is not SHA-256(payload) %x", contractID, sum)
	}
	if len(contract.GetParentId()) == 0 || contract.GetDepth() == 0 {
		return nil, verr(-1, "neither a root (no parent_id, depth 0) nor a child (a parent_id, depth >= 1)")
	}
	if carriesTreeTerms(contract) {
		return nil, verr(-1, "a child carries intent, policy or labels (the root's apply)")
	}
	return &VerifiedContract{ContractID: sum, Contract: contract, KeyID: id, Sealed: sealed}, nil
}

// ChainOf takes GetChain's answer as the Sealed contracts VerifyChain
// verifies, checking each state's contract_id against its payload.
func ChainOf(response *pb.GetChainResponse) ([]*pb.Sealed, error) {
	return sealedOfStates(response.GetChain())
}

func sealedOfStates(states []*pb.ContractState) ([]*pb.Sealed, error) {
	if len(states) > MaxChainContracts {
		return nil, verr(-1, "more than %d contracts: not a chain (the deepest policy is 64)", MaxChainContracts)
	}
	out := make([]*pb.Sealed, 0, len(states))
	for i, state := range states {
		if state.GetContract() == nil {
			return nil, verr(i, "carries no contract")
		}
		if len(state.GetContractId()) > 0 && !bytes.Equal(state.GetContractId(), SHA256(state.GetContract().GetPayload())) {
			return nil, verr(i, "its contract_id is not SHA-256 of its payload")
		}
		out = append(out, state.GetContract())
	}
	return out, nil
}

// VerifyGetChain verifies GetChain's answer (see VerifyChain).
func VerifyGetChain(response *pb.GetChainResponse, keys *BrokerKeys, contractID []byte) ([]*VerifiedContract, error) {
	sealed, err := ChainOf(response)
	if err != nil {
		return nil, err
	}
	return VerifyChain(sealed, keys, contractID)
}

// ConjoinPredicates is one step of the effective predicate's derivation
// (Contract.predicate in types.proto): inherited (the parent's effective
// predicate for a DELEGATE child, "" for a root or a PRINCIPAL child)
// conjoined with predicate, each part as "(" + p + "\n)".
func ConjoinPredicates(inherited, predicate string) (string, error) {
	var text string
	switch {
	case predicate == "":
		text = inherited
	case inherited == "":
		text = "(" + predicate + "\n)"
	default:
		text = inherited + " && (" + predicate + "\n)"
	}
	if len(text) > MaxEffectivePredicateBytes {
		return "", fmt.Errorf("the effective predicate exceeds %d bytes", MaxEffectivePredicateBytes)
	}
	return text, nil
}

// IsUnder reports whether path is under prefix: equal to it, or continuing
// with "/" after it; "/" covers every absolute path.
func IsUnder(path, prefix string) bool {
	if prefix == "/" {
		return strings.HasPrefix(path, "/")
	}
	return path == prefix || strings.HasPrefix(path, prefix+"/")
}

func carriesTreeTerms(c *pb.Contract) bool {
	return c.GetIntent() != "" || c.Policy != nil || len(c.GetLabels()) > 0
}

// VerifyChain verifies a chain of contracts, root first (GetChain's, see
// ChainOf), as types.proto's "Verifying a chain" says: the leaf's signature
// (strict ed25519, under the published key its payload names), the hash
// links (each parent_id its parent's SHA-256, depths +1, a root first, the
// leaf's id contractID when not nil), the root's terms, and each hop's terms
// against its parent, deriving the effective predicate root → leaf. More
// than MaxChainContracts contracts are refused. Errors are
// *VerificationError naming the contract at fault.
func VerifyChain(sealed []*pb.Sealed, keys *BrokerKeys, contractID []byte) ([]*VerifiedContract, error) {
	if len(sealed) == 0 {
		return nil, verr(-1, "the chain is empty")
	}
	if len(sealed) > MaxChainContracts {
		return nil, verr(-1, "more than %d contracts: not a chain (the deepest policy is 64)", MaxChainContracts)
	}
	contracts := make([]*pb.Contract, len(sealed))
	ids := make([][]byte, len(sealed))
	for i, s := range sealed {
		if s == nil {
			return nil, verr(i, "carries no contract")
		}
		contracts[i] = &pb.Contract{}
		if err := proto.Unmarshal(s.GetPayload(), contracts[i]); err != nil {
			return nil, verr(i, "the payload is not a delegation.broker.v1.Contract")
		}
		ids[i] = SHA256(s.GetPayload())
	}
	last := len(sealed) - 1
	if contractID != nil && !bytes.Equal(contractID, ids[last]) {
		return nil, verr(-1, "the last contract's id is %x, not the one asked for (%x)", ids[last], contractID)
	}
	if err := checkSignature(sealed[last], ContractType, contracts[last].GetBrokerKeyId(), keys, last); err != nil {
		return nil, err
	}
	return checkTerms(sealed, ids, contracts)
}

func checkTerms(sealed []*pb.Sealed, ids [][]byte, contracts []*pb.Contract) ([]*VerifiedContract, error) {
	root := contracts[0]
	if len(root.GetParentId()) > 0 || root.GetDepth() != 0 {
		return nil, verr(0, "the first contract is not a root (it names a parent or has depth > 0): the chain is cut")
	}
	if !bytes.Equal(root.GetIntentLineageHash(), LineageHash(root.GetIntent())) {
		return nil, verr(0, "intent_lineage_hash is not SHA-256(intent)")
	}
	if root.GetTrustSource() != pb.TrustSource_TRUST_SOURCE_ROOT || root.GetFactorPpm() != PPMOne || root.GetCumulativeTrustPpm() != PPMOne {
		return nil, verr(0, "a root's trust is ROOT, 1_000_000 ppm")
	}
	policy := root.GetPolicy()
	if policy == nil {
		return nil, verr(0, "the root carries no policy")
	}
	rootPredicate, err := ConjoinPredicates("", root.GetPredicate())
	if err != nil {
		return nil, verr(0, "%s", err)
	}
	out := []*VerifiedContract{{
		ContractID: ids[0], Contract: root, KeyID: root.GetBrokerKeyId(), Sealed: sealed[0],
		EffectivePredicate: rootPredicate, PrincipalPublicKey: root.GetDelegatePublicKey(), HasChain: true,
	}}
	for i := 1; i < len(contracts); i++ {
		p, c := contracts[i-1], contracts[i]
		fail := func(detail string) error { return verr(i, "%s", detail) }
		if !bytes.Equal(c.GetParentId(), ids[i-1]) {
			return nil, verr(i, "parent_id is not the id of contract %d", i-1)
		}
		if c.GetDepth() != p.GetDepth()+1 {
			return nil, fail("depth is not its parent's + 1")
		}
		if c.GetDepth() > policy.GetMaxDepth() {
			return nil, fail("depth exceeds the root policy's max_depth")
		}
		if carriesTreeTerms(c) {
			return nil, fail("a child carries intent, policy or labels (the root's apply)")
		}
		if !bytes.Equal(c.GetIntentLineageHash(), root.GetIntentLineageHash()) {
			return nil, fail("intent_lineage_hash differs from the root's")
		}
		// Integers only (uint32 × uint32 < 2^64): every language computes the same floor.
		expected := uint64(p.GetCumulativeTrustPpm()) * uint64(c.GetFactorPpm()) / PPMOne
		if c.GetFactorPpm() > PPMOne || uint64(c.GetCumulativeTrustPpm()) != expected {
			return nil, fail("cumulative_trust_ppm is not floor(parent x factor_ppm / 1_000_000)")
		}
		if c.GetCumulativeTrustPpm() < policy.GetMinCumulativeTrustPpm() {
			return nil, fail("cumulative trust is below the root policy's minimum")
		}
		if c.GetBudget() > p.GetBudget() || c.GetBudget() < 0 {
			return nil, fail("budget exceeds the parent's")
		}
		if c.GetDeadlineMs() > p.GetDeadlineMs() {
			return nil, fail("deadline is later than the parent's")
		}
		for _, path := range c.GetWriteScope() {
			covered := false
			for _, prefix := range p.GetWriteScope() {
				if IsUnder(path, prefix) {
					covered = true
					break
				}
			}
			if !covered {
				return nil, fail("write_scope reaches outside the parent's")
			}
		}
		if c.GetLiability() == pb.Liability_LIABILITY_DELEGATE && p.GetLiability() != pb.Liability_LIABILITY_DELEGATE {
			return nil, fail("a DELEGATE contract under a liability-retaining parent")
		}
		inherited := ""
		if c.GetLiability() == pb.Liability_LIABILITY_DELEGATE {
			inherited = out[i-1].EffectivePredicate
		}
		predicate, err := ConjoinPredicates(inherited, c.GetPredicate())
		if err != nil {
			return nil, verr(i, "%s", err)
		}
		out = append(out, &VerifiedContract{
			ContractID: ids[i], Contract: c, KeyID: c.GetBrokerKeyId(), Sealed: sealed[i],
			EffectivePredicate: predicate, PrincipalPublicKey: p.GetDelegatePublicKey(), HasChain: true,
		})
	}
	return out, nil
}

// VerifyEverySignature checks every contract's own signature, for an
// auditor who keeps each contract on its own (VerifyChain does not need it).
func VerifyEverySignature(sealed []*pb.Sealed, keys *BrokerKeys) error {
	if len(sealed) == 0 || len(sealed) > MaxChainContracts {
		return verr(-1, "a chain has 1 to %d contracts, not %d", MaxChainContracts, len(sealed))
	}
	for i, s := range sealed {
		if _, err := verifySealedAt(s, keys, &pb.Contract{}, i); err != nil {
			return err
		}
	}
	return nil
}

// Hex is lowercase hex, for ids in messages and logs.
func Hex(b []byte) string { return hex.EncodeToString(b) }
