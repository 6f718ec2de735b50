package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
	"github.com/delegation-broker/delegation-broker/clients/go/internal/brokertest"
)

// oneRun: an orchestrator gives an executor a task naming one file; the
// host records what the executor read and wrote (a write outside the scope
// in the "tree" arm), the executor completes with a typed report.
func oneRun(t *testing.T, ctx context.Context, b *brokertest.Broker, arm, run string, outside bool) []byte {
	orchestrator, executor, host := brokertest.Agent(t), brokertest.Agent(t), brokertest.Agent(t)
	oc := b.Client(t, orchestrator)
	root, err := oc.OpenRoot(ctx, &pb.OpenRootBody{
		Intent: "fix the token refresh bug", Budget: 100, DeadlineMs: broker.NowMs() + 3_600_000,
		Policy: &pb.Policy{MaxDepth: 2, MaxChildren: 4}, WriteScope: []string{"src"},
		Labels: map[string]string{"arm": arm, "run": run},
	})
	if err != nil {
		t.Fatal(err)
	}
	child, err := oc.Delegate(ctx, &pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: root.Contract.GetIntentLineageHash(),
		Task: "fix src/auth/token.go, see docs/", DelegatePublicKey: executor.PublicKey(), HostPublicKey: host.PublicKey(),
		Budget: 30, Liability: pb.Liability_LIABILITY_PRINCIPAL, Predicate: "result.within_scope", WriteScope: []string{"src/auth"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if arm == "flat" { // a refusal, counted by its primary code
		_, err := oc.Delegate(ctx, &pb.DelegateBody{ParentId: root.ContractID, IntentLineageHash: root.Contract.GetIntentLineageHash(),
			Task: "too much", DelegatePublicKey: executor.PublicKey(), Budget: 500, Liability: pb.Liability_LIABILITY_PRINCIPAL})
		var be *broker.BrokerError
		if !errors.As(err, &be) || be.Reason != broker.ReasonRefused {
			t.Fatalf("want a refusal, got %v", err)
		}
	}
	ec := b.Client(t, executor)
	if _, err := ec.Accept(ctx, &pb.AcceptBody{ContractId: child.ContractID}); err != nil {
		t.Fatal(err)
	}
	now := broker.NowMs()
	observations := []*pb.Observation{
		{Kind: pb.ObservationKind_OBSERVATION_KIND_TOOL_CALL, Tool: "grep", Units: 2, AtMs: now, Outcome: pb.ToolOutcome_TOOL_OUTCOME_SUCCEEDED},
		{Kind: pb.ObservationKind_OBSERVATION_KIND_READ, Path: "src/auth/token.go", AtMs: now},
		{Kind: pb.ObservationKind_OBSERVATION_KIND_READ, Path: "src/auth/session.go", AtMs: now},
		{Kind: pb.ObservationKind_OBSERVATION_KIND_MUTATION, Path: "src/auth/token.go", AtMs: now},
	}
	if outside {
		observations = append(observations, &pb.Observation{Kind: pb.ObservationKind_OBSERVATION_KIND_MUTATION, Path: "etc/passwd", AtMs: now})
	}
	if _, err := b.Client(t, host).RecordReceipts(ctx, &pb.RecordReceiptsBody{ContractId: child.ContractID, Observations: observations}); err != nil {
		t.Fatal(err)
	}
	if _, err := ec.Complete(ctx, &pb.CompleteBody{ContractId: child.ContractID, OutputJson: `{"fixed":true}`,
		Report: &pb.TypedReport{Status: "done", Summary: "fixed"}, Claim: "success", Consumed: 5}); err != nil {
		t.Fatal(err)
	}
	return child.ContractID
}

// The example prints the same aggregates as `delegation-broker audit` for
// the same runs.
func TestSameTableAsTheBrokersAudit(t *testing.T) {
	b := brokertest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	oneRun(t, ctx, b, "flat", "1", false)
	oneRun(t, ctx, b, "flat", "2", true)
	treeChild := oneRun(t, ctx, b, "tree", "1", true)

	keyFile := filepath.Join(t.TempDir(), "reader.key")
	if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(b.Reader.Seed())+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, groupBy := range [][]string{{"arm"}, {"arm", "run"}} {
		var mine bytes.Buffer
		args := []string{"-addr", b.Address, "-key-file", keyFile}
		cli := []string{"audit", "--addr", "http://" + b.Address, "--key-file", keyFile}
		for _, k := range groupBy {
			args = append(args, "-group-by", k)
			cli = append(cli, "--group-by", k)
		}
		if err := run(ctx, args, &mine); err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx, brokertest.Bin(t), cli...)
		cmd.Env = append(os.Environ(), "BROKER_LOG=error")
		theirs, err := cmd.Output()
		if err != nil {
			t.Fatalf("delegation-broker audit: %v", err)
		}
		if mine.String() != string(theirs) {
			t.Fatalf("group by %v: the example printed\n%s\ndelegation-broker audit printed\n%s", groupBy, mine.String(), theirs)
		}
		if !strings.Contains(mine.String(), "arm=flat") || !strings.Contains(mine.String(), "arm=tree") {
			t.Fatalf("arms missing:\n%s", mine.String())
		}
		t.Logf("group by %v:\n%s", groupBy, mine.String())
	}
	var report bytes.Buffer
	if err := run(ctx, []string{"-addr", b.Address, "-key-file", keyFile, "-contract", hex.EncodeToString(treeChild)}, &report); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(report.String(), "claim violations 1") || !strings.Contains(report.String(), "false completion true") {
		t.Fatalf("contract report:\n%s", report.String())
	}
}
