package broker_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
	"github.com/delegation-broker/delegation-broker/clients/go/internal/brokertest"
)

// Cross-language: what Go agents were issued verifies in Python, TypeScript
// and Rust with the same printed terms, a flipped byte fails in all four,
// and chains and receipts Python and TypeScript agents were issued verify in
// Go. Needs CROSS_PYTHON (a Python with the Python client) and CROSS_TS_DIST
// (the TypeScript client's build): run-tests.sh sets both; without them the
// test fails, it is never skipped.

// FlipStride: every FlipStride-th byte of a signed payload is flipped.
const flipStride = 11

func crossTools(t *testing.T) (python, pyScript, node, tsScript string) {
	python, dist := os.Getenv("CROSS_PYTHON"), os.Getenv("CROSS_TS_DIST")
	if python == "" || dist == "" {
		t.Fatal("CROSS_PYTHON and CROSS_TS_DIST must be set (clients/go/run-tests.sh sets them)")
	}
	root := brokertest.RepoRoot(t)
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is needed for the TypeScript side: ", err)
	}
	return python, filepath.Join(root, "clients", "typescript", "test", "cross", "cross.py"), node,
		filepath.Join(root, "clients", "go", "testdata", "cross", "cross.mjs")
}

func rustDebug(s string) string {
	r := strings.NewReplacer("\\", "\\\\", "\"", "\\\"", "\n", "\\n", "\r", "\\r", "\t", "\\t", "\x00", "\\0")
	return "\"" + r.Replace(s) + "\""
}

// chainLines is what `delegation-broker verify --chain` prints.
func chainLines(verified []*broker.VerifiedContract) string {
	var lines []string
	for _, v := range verified {
		c := v.Contract
		lines = append(lines, fmt.Sprintf("depth=%d id=%x delegate=%s budget=%d deadline_ms=%d trust_ppm=%d liability=%s effective_predicate=%s",
			c.GetDepth(), v.ContractID, broker.KeyID(c.GetDelegatePublicKey()), c.GetBudget(), c.GetDeadlineMs(), c.GetCumulativeTrustPpm(),
			c.GetLiability(), rustDebug(v.EffectivePredicate)))
	}
	return strings.Join(append(lines, fmt.Sprintf("ok chain of %d contracts", len(verified))), " | ")
}

func goChainVerdict(data []byte, keys *broker.BrokerKeys, leaf []byte) string {
	response := &pb.GetChainResponse{}
	if proto.Unmarshal(data, response) != nil {
		return "error"
	}
	verified, err := broker.VerifyGetChain(response, keys, leaf)
	if err != nil {
		return "error"
	}
	return chainLines(verified)
}

func goReceiptVerdict(data []byte, keys *broker.BrokerKeys) string {
	sealed := &pb.Sealed{}
	if proto.Unmarshal(data, sealed) != nil {
		return "error"
	}
	v, err := broker.VerifyReceipt(sealed, keys, nil)
	if err != nil {
		return "error"
	}
	return fmt.Sprintf("ok receipt %x kind=%s contract=%x", v.ReceiptID, v.Receipt.GetKind(), v.Receipt.GetContractId())
}

func verdicts(t *testing.T, out []byte) map[string]string {
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		name, verdict, ok := strings.Cut(line, "\t")
		if !ok {
			t.Fatalf("odd line %q", line)
		}
		if strings.HasPrefix(verdict, "crash:") {
			t.Fatalf("%s crashed: %s", name, verdict)
		}
		if strings.HasPrefix(verdict, "error") {
			verdict = "error"
		}
		got[name] = verdict
	}
	return got
}

func run(t *testing.T, name string, args ...string) []byte {
	cmd := exec.Command(name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	return out
}

func rustVerdict(t *testing.T, args ...string) string {
	cmd := exec.Command(brokertest.Bin(t), append([]string{"verify"}, args...)...)
	cmd.Env = []string{"BROKER_LOG=error", "PATH=/usr/bin:/bin"}
	out, err := cmd.Output()
	if err != nil {
		return "error"
	}
	return strings.Join(strings.Split(strings.TrimRight(string(out), "\n"), "\n"), " | ")
}

func flipped(payload []byte) [][]byte {
	var out [][]byte
	for i := 0; i < len(payload); i += flipStride {
		p := append([]byte(nil), payload...)
		p[i] ^= 0x01
		out = append(out, p)
	}
	return out
}

func write(t *testing.T, path string, m proto.Message) {
	data, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestCrossLanguage(t *testing.T) {
	python, pyScript, node, tsScript := crossTools(t)
	b := brokertest.Start(t)
	ctx := ctxFor(t)
	orchestrator, planner, executor, reviewer := brokertest.Agent(t), brokertest.Agent(t), brokertest.Agent(t), brokertest.Agent(t)
	c := b.Client(t, orchestrator)
	root, err := c.OpenRoot(ctx, rootBody(100, &pb.Policy{MaxDepth: 4, MaxChildren: 8, MinCumulativeTrustPpm: 500_000}))
	if err != nil {
		t.Fatal(err)
	}
	lineage := root.Contract.GetIntentLineageHash()
	plannerIssued, err := c.Delegate(ctx, &pb.DelegateBody{ParentId: root.ContractID, IntentLineageHash: lineage, Task: "ü — a Go hop",
		DelegatePublicKey: planner.PublicKey(), DelegateAttestation: mustAttest(t, b.Attestor, planner, 0.9), Budget: 40,
		Liability: pb.Liability_LIABILITY_DELEGATE, Predicate: "result.ok", EscalationChannel: "broker://escalate", MinRetryCost: 5, WriteScope: []string{"src"}})
	if err != nil {
		t.Fatal(err)
	}
	pc := b.Client(t, planner)
	leaf, err := pc.Delegate(ctx, &pb.DelegateBody{ParentId: plannerIssued.ContractID, IntentLineageHash: lineage, Task: "review",
		DelegatePublicKey: executor.PublicKey(), DelegateAttestation: mustAttest(t, b.Attestor, executor, 0.8), Budget: 10,
		Liability: pb.Liability_LIABILITY_PRINCIPAL, Predicate: "result.reviewed", WriteScope: []string{"src/auth/a.rs"}})
	if err != nil {
		t.Fatal(err)
	}
	_, refusal := pc.Delegate(ctx, &pb.DelegateBody{ParentId: plannerIssued.ContractID, IntentLineageHash: lineage, Task: "too much",
		DelegatePublicKey: reviewer.PublicKey(), Budget: 1_000, Liability: pb.Liability_LIABILITY_PRINCIPAL})
	refused := refusal.(*broker.BrokerError).Refusal
	accepted, err := b.Client(t, executor).Accept(ctx, &pb.AcceptBody{ContractId: leaf.ContractID})
	if err != nil {
		t.Fatal(err)
	}
	chain, err := c.Raw().GetChain(ctxWithSession(t, c), &pb.GetChainRequest{ContractId: leaf.ContractID})
	if err != nil {
		t.Fatal(err)
	}
	keys, err := c.Keys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var keyHex []string
	var keyArgs []string
	for _, k := range keys.PublicKeys() {
		keyHex = append(keyHex, broker.Hex(k))
		keyArgs = append(keyArgs, "--public-key", broker.Hex(k))
	}
	leafHex := broker.Hex(leaf.ContractID)

	// Go's chain: the genuine one and every flipped leaf payload byte.
	dir := t.TempDir()
	chains := filepath.Join(dir, "chains")
	receipts := filepath.Join(dir, "receipts")
	for _, d := range []string{chains, receipts} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	variants := []*pb.GetChainResponse{chain}
	last := chain.GetChain()[len(chain.GetChain())-1]
	for _, p := range flipped(last.GetContract().GetPayload()) {
		forged := proto.Clone(chain).(*pb.GetChainResponse)
		forged.Chain[len(forged.Chain)-1].Contract.Payload = p
		forged.Chain[len(forged.Chain)-1].ContractId = nil
		variants = append(variants, forged)
	}
	for i, v := range variants {
		write(t, filepath.Join(chains, fmt.Sprintf("%05d.bin", i)), v)
	}
	sealedReceipts := []*pb.Sealed{refused.Sealed, accepted.Sealed}
	for _, p := range flipped(accepted.Sealed.GetPayload()) {
		sealedReceipts = append(sealedReceipts, &pb.Sealed{Payload: p, Signature: accepted.Sealed.GetSignature()})
	}
	for i, s := range sealedReceipts {
		write(t, filepath.Join(receipts, fmt.Sprintf("%05d.bin", i)), s)
	}
	tsEnv := os.Environ()
	py := verdicts(t, run(t, python, pyScript, "verify-chains", strings.Join(keyHex, ","), chains, leafHex))
	tsv := verdicts(t, runEnv(t, tsEnv, node, tsScript, "verify-chains", strings.Join(keyHex, ","), chains, leafHex))
	for i, v := range variants {
		name := fmt.Sprintf("%05d", i)
		data, _ := proto.Marshal(v)
		goVerdict := goChainVerdict(data, keys, leaf.ContractID)
		rust := rustVerdict(t, append(append([]string(nil), keyArgs...), "--chain", filepath.Join(chains, name+".bin"), "--contract-id", leafHex)...)
		if i == 0 && !strings.HasSuffix(goVerdict, "ok chain of 3 contracts") {
			t.Fatalf("Go on its own chain: %s", goVerdict)
		}
		if i > 0 && goVerdict != "error" {
			t.Fatalf("Go accepts flipped chain %s", name)
		}
		if py[name] != goVerdict || tsv[name] != goVerdict || rust != goVerdict {
			t.Fatalf("chain %s: Go %q, Python %q, TypeScript %q, Rust %q", name, goVerdict, py[name], tsv[name], rust)
		}
	}
	py = verdicts(t, run(t, python, pyScript, "verify-receipts", strings.Join(keyHex, ","), receipts))
	tsv = verdicts(t, run(t, node, tsScript, "verify-receipts", strings.Join(keyHex, ","), receipts))
	for i, s := range sealedReceipts {
		name := fmt.Sprintf("%05d", i)
		data, _ := proto.Marshal(s)
		goVerdict := goReceiptVerdict(data, keys)
		if (i < 2) != strings.HasPrefix(goVerdict, "ok receipt") {
			t.Fatalf("Go on receipt %s: %s", name, goVerdict)
		}
		if py[name] != goVerdict || tsv[name] != goVerdict {
			t.Fatalf("receipt %s: Go %q, Python %q, TypeScript %q", name, goVerdict, py[name], tsv[name])
		}
	}

	// Chains and receipts Python and TypeScript agents were issued, in Go.
	for _, side := range []struct{ lang, bin, script, task string }{
		{"python", python, pyScript, "ü — a Python hop"},
		{"typescript", node, tsScript, "ü — a TypeScript hop"},
	} {
		out := filepath.Join(dir, side.lang)
		run(t, side.bin, side.script, "issue", b.Address, out)
		data, err := os.ReadFile(filepath.Join(out, "chain.bin"))
		if err != nil {
			t.Fatal(err)
		}
		response := &pb.GetChainResponse{}
		if err := proto.Unmarshal(data, response); err != nil {
			t.Fatal(err)
		}
		leafID := response.GetChain()[len(response.GetChain())-1].GetContractId()
		verified, err := broker.VerifyGetChain(response, keys, leafID)
		if err != nil {
			t.Fatalf("%s chain in Go: %v", side.lang, err)
		}
		if len(verified) != 4 || verified[0].Contract.GetLabels()["client"] != side.lang || verified[1].Contract.GetTask() != side.task ||
			verified[2].EffectivePredicate != "(result.schema_valid\n) && (result.tests_pass\n)" || verified[3].EffectivePredicate != "(result.reviewed\n)" {
			t.Fatalf("%s chain terms: %s", side.lang, chainLines(verified))
		}
		if rust := rustVerdict(t, append(append([]string(nil), keyArgs...), "--chain", filepath.Join(out, "chain.bin"), "--contract-id", broker.Hex(leafID))...); rust != chainLines(verified) {
			t.Fatalf("%s chain: Go %q, Rust %q", side.lang, chainLines(verified), rust)
		}
		for i, p := range flipped(response.GetChain()[3].GetContract().GetPayload()) {
			forged := proto.Clone(response).(*pb.GetChainResponse)
			forged.Chain[3].Contract.Payload = p
			if _, err := broker.VerifyGetChain(forged, keys, nil); err == nil {
				t.Fatalf("%s chain with byte %d flipped verifies in Go", side.lang, i*flipStride)
			}
		}
		for _, name := range []string{"refusal.bin", "accepted.bin"} {
			data, err := os.ReadFile(filepath.Join(out, name))
			if err != nil {
				t.Fatal(err)
			}
			if v := goReceiptVerdict(data, keys); !strings.HasPrefix(v, "ok receipt") {
				t.Fatalf("%s %s in Go: %s", side.lang, name, v)
			}
		}
		data, _ = os.ReadFile(filepath.Join(out, "request.bin"))
		envelope := &pb.Envelope{}
		signer, _ := os.ReadFile(filepath.Join(out, "orchestrator.hex"))
		if proto.Unmarshal(data, envelope) != nil || !broker.VerifySignature(envelope, unhex(t, strings.TrimSpace(string(signer))), "application/vnd.delegation.broker.v1.DelegateBody+protobuf") {
			t.Fatalf("%s's signed Delegate does not verify in Go", side.lang)
		}
		envelope.Payload = envelope.Payload[1:]
		if broker.VerifySignature(envelope, unhex(t, strings.TrimSpace(string(signer))), "") {
			t.Fatalf("%s's envelope cut short verifies in Go", side.lang)
		}
	}
	t.Logf("%d chains and %d receipts judged alike by Go, Python, TypeScript and Rust", len(variants), len(sealedReceipts))
}

func runEnv(t *testing.T, env []string, name string, args ...string) []byte {
	cmd := exec.Command(name, args...)
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", name, err, stderr.String())
	}
	return out
}
