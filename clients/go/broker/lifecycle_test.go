package broker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
	"github.com/delegation-broker/delegation-broker/clients/go/internal/brokertest"
)

const testTimeout = 60 * time.Second

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

func rootBody(budget int64, policy *pb.Policy) *pb.OpenRootBody {
	return &pb.OpenRootBody{
		Intent: "fix the token refresh bug — from Go", Budget: budget, DeadlineMs: broker.NowMs() + 3_600_000,
		Policy: policy, Predicate: "result.schema_valid", WriteScope: []string{"src", "docs"},
		Labels: map[string]string{"client": "go"},
	}
}

func mustAttest(t *testing.T, attestor *broker.Agent, agent *broker.Agent, factor float64) *pb.Envelope {
	e, err := attestor.Attest(agent.PublicKey(), factor, broker.NowMs()+3_600_000, "sandboxed")
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// Acceptance: open a root, delegate, be refused with every violated code and
// its requested/allowed values, accept, complete, verify the chain offline.
func TestLifecycle(t *testing.T) {
	b := brokertest.Start(t)
	ctx := ctxFor(t)
	orchestrator, planner, executor := brokertest.Agent(t), brokertest.Agent(t), brokertest.Agent(t)
	oc := b.Client(t, orchestrator)

	root, err := oc.OpenRoot(ctx, rootBody(100, &pb.Policy{MaxDepth: 3, MinCumulativeTrustPpm: 500_000, MaxChildren: 1}))
	if err != nil {
		t.Fatal(err)
	}
	if root.Replayed || root.Contract.GetDepth() != 0 || root.EffectivePredicate != "(result.schema_valid\n)" {
		t.Fatalf("root: %+v", root)
	}
	lineage := root.Contract.GetIntentLineageHash()

	toPlanner := &pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: lineage, Task: "plan the fix in src/auth/",
		DelegatePublicKey: planner.PublicKey(), DelegateAttestation: mustAttest(t, b.Attestor, planner, 0.9),
		Budget: 40, Liability: pb.Liability_LIABILITY_DELEGATE, Predicate: "result.within_scope",
		EscalationChannel: "broker://escalate", MinRetryCost: 5, WriteScope: []string{"src/auth"},
	}
	plannerIssued, err := oc.Delegate(ctx, toPlanner)
	if err != nil {
		t.Fatal(err)
	}
	if got := plannerIssued.Contract.GetCumulativeTrustPpm(); got != 900_000 {
		t.Fatalf("planner trust %d", got)
	}

	// A second child of the root breaks nearly every rule at once (its
	// predicate is the root's, inherited: LIABILITY_WITHOUT_PREDICATE holds).
	parentDeadline := root.Contract.GetDeadlineMs()
	_, err = oc.Delegate(ctx, &pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: broker.LineageHash("another intent"), Task: "everything wrong",
		DelegatePublicKey: executor.PublicKey(), Budget: 1_000, DeadlineMs: parentDeadline + 60_000,
		Liability: pb.Liability_LIABILITY_DELEGATE, MinRetryCost: 2_000, WriteScope: []string{"etc"},
	})
	var be *broker.BrokerError
	if !errors.As(err, &be) {
		t.Fatalf("want a *BrokerError, got %v", err)
	}
	if be.Reason != broker.ReasonRefused || be.Code != codes.FailedPrecondition || be.Refusal == nil {
		t.Fatalf("refusal: %v", be)
	}
	want := map[pb.InvariantCode][2]string{
		pb.InvariantCode_INVARIANT_CODE_INTENT_DILUTED:               {broker.Hex(broker.LineageHash("another intent")), broker.Hex(lineage)},
		pb.InvariantCode_INVARIANT_CODE_TRUST_ATTENUATED:             {"0", "500000"},
		pb.InvariantCode_INVARIANT_CODE_LIABILITY_WITHOUT_ESCALATION: {"DELEGATE", "PRINCIPAL"},
		pb.InvariantCode_INVARIANT_CODE_BELOW_RETRY_COST:             {"1000", "2000"},
		pb.InvariantCode_INVARIANT_CODE_BUDGET_EXCEEDS_PARENT:        {"1000", "60"},
		pb.InvariantCode_INVARIANT_CODE_DEADLINE_EXCEEDS_PARENT:      {fmt.Sprint(parentDeadline + 60_000), fmt.Sprint(parentDeadline)},
		pb.InvariantCode_INVARIANT_CODE_NO_RETRY_HEADROOM:            {"-940", "2000"},
		pb.InvariantCode_INVARIANT_CODE_SCOPE_WIDENED:                {"etc", "docs,src"},
		pb.InvariantCode_INVARIANT_CODE_FANOUT_EXCEEDED:              {"2", "1"},
	}
	got := map[pb.InvariantCode][2]string{}
	for _, v := range be.Violations {
		got[v.Code] = [2]string{v.Requested, v.Allowed}
	}
	for code, values := range want {
		if got[code] != values {
			t.Errorf("%s: got requested/allowed %q, want %q", broker.InvariantName(code), got[code], values)
		}
	}
	for code := range got {
		if _, ok := want[code]; !ok {
			t.Errorf("unexpected violation %s %q", broker.InvariantName(code), got[code])
		}
	}
	if r := be.Refusal.Receipt; r.GetKind() != pb.ReceiptKind_RECEIPT_KIND_REFUSED || string(r.GetContractId()) != string(root.ContractID) || r.GetPrimary() != be.Violations[0].Code {
		t.Fatalf("refusal receipt %v", r)
	}

	// The planner accepts, delegates on, the executor accepts and completes.
	pc := b.Client(t, planner)
	if _, err := pc.Accept(ctx, &pb.AcceptBody{ContractId: plannerIssued.ContractID}); err != nil {
		t.Fatal(err)
	}
	executorIssued, err := pc.Delegate(ctx, &pb.DelegateBody{
		ParentId: plannerIssued.ContractID, IntentLineageHash: lineage, Task: "edit src/auth/token.go",
		DelegatePublicKey: executor.PublicKey(), DelegateAttestation: mustAttest(t, b.Attestor, executor, 0.8),
		Budget: 10, Liability: pb.Liability_LIABILITY_PRINCIPAL, WriteScope: []string{"src/auth/token.go"},
	})
	if err != nil {
		t.Fatal(err)
	}
	ec := b.Client(t, executor)
	accepted, err := ec.Accept(ctx, &pb.AcceptBody{ContractId: executorIssued.ContractID})
	if err != nil || accepted.Receipt.GetKind() != pb.ReceiptKind_RECEIPT_KIND_ACCEPTED {
		t.Fatalf("accept: %v %v", accepted, err)
	}
	completed, err := ec.Complete(ctx, &pb.CompleteBody{ContractId: executorIssued.ContractID, OutputJson: `{"ok":true}`, Claim: "success", Consumed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if completed.Receipt.GetKind() != pb.ReceiptKind_RECEIPT_KIND_COMPLETED || completed.Receipt.GetCompletion().GetConsumed() != 3 {
		t.Fatalf("completion: %v", completed.Receipt)
	}

	// The chain, verified offline from GetBrokerKeys alone.
	chain, err := oc.GetChain(ctx, executorIssued.ContractID)
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 3 || chain[2].EffectivePredicate != "" || chain[1].EffectivePredicate != "(result.schema_valid\n) && (result.within_scope\n)" ||
		chain[2].Contract.GetCumulativeTrustPpm() != 720_000 || string(chain[2].PrincipalPublicKey) != string(planner.PublicKey()) {
		t.Fatalf("chain: %+v", chain)
	}
	raw, err := oc.Raw().GetBrokerKeys(ctx, &pb.GetBrokerKeysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	keys, err := broker.NewBrokerKeys(raw.GetKeys())
	if err != nil {
		t.Fatal(err)
	}
	sealed := []*pb.Sealed{chain[0].Sealed, chain[1].Sealed, chain[2].Sealed}
	if _, err := broker.VerifyChain(sealed, keys, executorIssued.ContractID); err != nil {
		t.Fatal(err)
	}
	if err := broker.VerifyEverySignature(sealed, keys); err != nil {
		t.Fatal(err)
	}
	if _, err := broker.VerifyChain(sealed[:2], keys, executorIssued.ContractID); err == nil {
		t.Fatal("a chain cut at its end verified as the leaf's")
	}
	state, err := oc.GetContract(ctx, executorIssued.ContractID)
	if err != nil || state.GetStatus() != pb.ContractStatus_CONTRACT_STATUS_COMPLETED {
		t.Fatalf("state %v %v", state, err)
	}
}

// failFirst lets the first call of each method reach the broker and be
// answered, then reports UNAVAILABLE as if the answer had been lost.
func failFirst() grpc.UnaryClientInterceptor {
	seen := map[string]bool{}
	return func(ctx context.Context, method string, req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err == nil && !seen[method] && (method == "/delegation.broker.v1.Broker/OpenRoot" || method == "/delegation.broker.v1.Broker/Delegate") {
			seen[method] = true
			return status.Error(codes.Unavailable, "the answer was lost (simulated)")
		}
		return err
	}
}

// Acceptance: a resend after a simulated UNAVAILABLE returns replayed: true,
// and reserved nothing twice.
func TestResendAfterUnavailableIsReplayed(t *testing.T) {
	b := brokertest.Start(t)
	ctx := ctxFor(t)
	orchestrator, planner := brokertest.Agent(t), brokertest.Agent(t)
	c := b.Client(t, orchestrator, grpc.WithUnaryInterceptor(failFirst()))
	root, err := c.OpenRoot(ctx, rootBody(100, &pb.Policy{MaxDepth: 2, MaxChildren: 4}))
	if err != nil {
		t.Fatal(err)
	}
	if !root.Replayed {
		t.Fatal("OpenRoot resent after UNAVAILABLE was not replayed")
	}
	request, err := orchestrator.Delegate(&pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: root.Contract.GetIntentLineageHash(), Task: "t",
		DelegatePublicKey: planner.PublicKey(), Budget: 30, Liability: pb.Liability_LIABILITY_PRINCIPAL,
	})
	if err != nil {
		t.Fatal(err)
	}
	child, err := c.SendDelegate(ctx, request)
	if err != nil {
		t.Fatal(err)
	}
	if !child.Replayed {
		t.Fatal("Delegate resent after UNAVAILABLE was not replayed")
	}
	again, err := c.SendDelegate(ctx, request)
	if err != nil || !again.Replayed || string(again.ContractID) != string(child.ContractID) {
		t.Fatalf("a third send: %v %v", again, err)
	}
	state, err := c.GetContract(ctx, root.ContractID)
	if err != nil {
		t.Fatal(err)
	}
	if l := state.GetLedger(); l.GetReserved() != 30 || l.GetOpenChildren() != 1 {
		t.Fatalf("reserved twice: %v", l)
	}
	// Without retries the simulated loss surfaces as UNAVAILABLE, retryable;
	// the same bytes sent again are answered from the request log.
	once := broker.New(b.Dial(t, grpc.WithUnaryInterceptor(failFirst())), orchestrator,
		broker.WithRetryPolicy(broker.RetryPolicy{Attempts: 1, AttemptTimeout: broker.DefaultCallTimeout}))
	second, err := orchestrator.Delegate(&pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: root.Contract.GetIntentLineageHash(), Task: "t2",
		DelegatePublicKey: planner.PublicKey(), Budget: 20, Liability: pb.Liability_LIABILITY_PRINCIPAL,
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = once.SendDelegate(ctx, second)
	var be *broker.BrokerError
	if !errors.As(err, &be) || be.Code != codes.Unavailable || !broker.Retryable(err) {
		t.Fatalf("one attempt after a lost answer: %v", err)
	}
	resent, err := c.SendDelegate(ctx, second)
	if err != nil || !resent.Replayed {
		t.Fatalf("the resend: %v %v", resent, err)
	}
}

// Errors carry the broker's reason and field, and work with errors.As and
// status.Code.
func TestErrorsCarryReason(t *testing.T) {
	b := brokertest.Start(t)
	ctx := ctxFor(t)
	orchestrator, stranger := brokertest.Agent(t), brokertest.Agent(t)
	c := b.Client(t, orchestrator)
	root, err := c.OpenRoot(ctx, rootBody(100, &pb.Policy{MaxDepth: 2, MaxChildren: 4}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Client(t, stranger).GetContract(ctx, root.ContractID)
	var be *broker.BrokerError
	if !errors.As(err, &be) || be.Code != codes.NotFound || be.Reason != "NOT_FOUND" || status.Code(err) != codes.NotFound {
		t.Fatalf("a stranger's read: %v", err)
	}
	_, err = c.OpenRoot(ctx, &pb.OpenRootBody{Intent: "x", Budget: 0, DeadlineMs: broker.NowMs() + 60_000, Policy: &pb.Policy{MaxDepth: 1, MaxChildren: 1}})
	if !errors.As(err, &be) || be.Code != codes.InvalidArgument || be.Reason != "INVALID_FIELD" || be.Field != "body.budget" || len(be.FieldViolations) == 0 {
		t.Fatalf("budget 0: %#v", err)
	}
	// The same nonce with another body.
	header, err := orchestrator.Header()
	if err != nil {
		t.Fatal(err)
	}
	first := rootBody(10, &pb.Policy{MaxDepth: 1, MaxChildren: 1})
	first.Header = header
	if _, err := c.OpenRoot(ctx, first); err != nil {
		t.Fatal(err)
	}
	second := rootBody(11, &pb.Policy{MaxDepth: 1, MaxChildren: 1})
	second.Header = header
	_, err = c.OpenRoot(ctx, second)
	if !errors.As(err, &be) || be.Code != codes.AlreadyExists || be.Reason != "NONCE_REUSED" {
		t.Fatalf("nonce reuse: %v", err)
	}
	// A deadline already past: DEADLINE_EXCEEDED, as a *BrokerError.
	past, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	_, err = c.GetContract(past, root.ContractID)
	if !errors.As(err, &be) || be.Code != codes.DeadlineExceeded {
		t.Fatalf("past deadline: %v", err)
	}
}

// Watch from cursor 0 sees every event verified; resumed from a cursor it
// sees the rest and nothing twice.
func TestWatchResumes(t *testing.T) {
	b := brokertest.Start(t)
	ctx := ctxFor(t)
	orchestrator, planner := brokertest.Agent(t), brokertest.Agent(t)
	c := b.Client(t, orchestrator)
	root, err := c.OpenRoot(ctx, rootBody(100, &pb.Policy{MaxDepth: 2, MaxChildren: 4}))
	if err != nil {
		t.Fatal(err)
	}
	child, err := c.Delegate(ctx, &pb.DelegateBody{ParentId: root.ContractID, IntentLineageHash: root.Contract.GetIntentLineageHash(),
		Task: "t", DelegatePublicKey: planner.PublicKey(), Budget: 10, Liability: pb.Liability_LIABILITY_PRINCIPAL})
	if err != nil {
		t.Fatal(err)
	}
	w := c.Watch(root.ContractID, 0)
	first, err := w.Next(ctx)
	if err != nil || first.Contract == nil || string(first.ID) != string(root.ContractID) {
		t.Fatalf("first event %v %v", first, err)
	}
	w.Close()
	if _, err := b.Client(t, planner).Accept(ctx, &pb.AcceptBody{ContractId: child.ContractID}); err != nil {
		t.Fatal(err)
	}
	resumed := c.Watch(root.ContractID, w.Cursor())
	defer resumed.Close()
	second, err := resumed.Next(ctx)
	if err != nil || second.Contract == nil || string(second.ID) != string(child.ContractID) || second.Cursor <= first.Cursor {
		t.Fatalf("second event %v %v", second, err)
	}
	third, err := resumed.Next(ctx)
	if err != nil || third.Receipt == nil || third.Receipt.GetKind() != pb.ReceiptKind_RECEIPT_KIND_ACCEPTED {
		t.Fatalf("third event %v %v", third, err)
	}
}

// ctxWithSession is a context carrying c's read session, for the raw stub.
func ctxWithSession(t *testing.T, c *broker.Client) context.Context {
	ctx := ctxFor(t)
	s, err := c.Session().Current(ctx)
	if err != nil {
		t.Fatal(err)
	}
	data, err := proto.Marshal(s.Sealed)
	if err != nil {
		t.Fatal(err)
	}
	return metadata.AppendToOutgoingContext(ctx, broker.SessionHeader, string(data))
}
