package broker

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// DefaultCallTimeout is the deadline of one attempt of a call whose
	// context has none.
	DefaultCallTimeout = 10 * time.Second
	// DefaultAttempts is how many times a signed request is sent at most.
	DefaultAttempts = 5
	// DefaultInitialBackoff is the wait before the second attempt, doubled
	// after each (jittered to 50–100%), at most DefaultMaxBackoff.
	DefaultInitialBackoff = 100 * time.Millisecond
	// DefaultMaxBackoff is the longest wait between attempts.
	DefaultMaxBackoff = 2 * time.Second
	// SessionHeader is the binary gRPC metadata key a read's session
	// travels in (gRPC base64-encodes "-bin" values itself).
	SessionHeader = "x-broker-session-bin"
	// RenewAt is the fraction of a session's lifetime after which the next
	// read opens a new one.
	RenewAt = 0.9
)

// RetryPolicy says how CallIdempotent resends a signed request.
type RetryPolicy struct {
	// Attempts in all, the first included (at least 1).
	Attempts int
	// InitialBackoff before the second attempt, doubled each time.
	InitialBackoff time.Duration
	// MaxBackoff caps the wait.
	MaxBackoff time.Duration
	// AttemptTimeout is each attempt's deadline when ctx has none.
	AttemptTimeout time.Duration
}

// DefaultRetryPolicy is the policy of a Client unless told otherwise.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{Attempts: DefaultAttempts, InitialBackoff: DefaultInitialBackoff, MaxBackoff: DefaultMaxBackoff, AttemptTimeout: DefaultCallTimeout}
}

// Retryable reports whether resending the same signed request after err is
// safe and useful: UNAVAILABLE (the transport failed, or the broker shed
// load and asks for a retry with the same nonce) and DEADLINE_EXCEEDED (the
// answer was lost). RESOURCE_EXHAUSTED names a limit a resend meets again.
func Retryable(err error) bool {
	if err == nil {
		return false
	}
	c := toBrokerError(err).Code
	return c == codes.Unavailable || c == codes.DeadlineExceeded
}

func withDefaultTimeout(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, timeout)
}

func jitter(d time.Duration) time.Duration {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return d
	}
	half := int64(d) / 2
	if half <= 0 {
		return d
	}
	return time.Duration(half + int64(binary.LittleEndian.Uint64(b[:])%uint64(half+1)))
}

// CallIdempotent calls call(ctx, request), resending the very same request
// (same nonce, same bytes) while the error is Retryable, up to
// policy.Attempts times, with jittered exponential backoff; it stops when
// ctx ends. The broker answers a resent request it already answered from its
// request log (replayed: true) and never reserves twice. The error is a
// *BrokerError.
//
// request must be signed once (agent.Delegate(body) and the like), never
// re-signed per attempt.
func CallIdempotent[Req, Res any](ctx context.Context, call func(context.Context, Req, ...grpc.CallOption) (Res, error), request Req, policy RetryPolicy, opts ...grpc.CallOption) (Res, error) {
	var zero Res
	if policy.Attempts < 1 {
		return zero, fmt.Errorf("broker: a retry policy needs at least 1 attempt, not %d", policy.Attempts)
	}
	backoff := policy.InitialBackoff
	for attempt := 1; ; attempt++ {
		attemptCtx, cancel := withDefaultTimeout(ctx, policy.AttemptTimeout)
		response, err := call(attemptCtx, request, opts...)
		cancel()
		if err == nil {
			return response, nil
		}
		if attempt >= policy.Attempts || !Retryable(err) || ctx.Err() != nil {
			return zero, AsBrokerError(err)
		}
		timer := time.NewTimer(jitter(backoff))
		select {
		case <-ctx.Done():
			timer.Stop()
			return zero, AsBrokerError(err)
		case <-timer.C:
		}
		if backoff *= 2; backoff > policy.MaxBackoff {
			backoff = policy.MaxBackoff
		}
	}
}

// Option configures a Client.
type Option func(*Client)

// WithRetryPolicy sets how signed requests are resent.
func WithRetryPolicy(p RetryPolicy) Option { return func(c *Client) { c.retry = p } }

// WithBrokerKeys sets the keys to verify with (default: fetched once with
// GetBrokerKeys, and again when a signature names a key not seen yet).
func WithBrokerKeys(k *BrokerKeys) Option { return func(c *Client) { c.keys = k } }

// Client signs as one agent, sends, resends on UNAVAILABLE, carries its
// read session and verifies every contract and receipt it gets back. It is
// safe for concurrent use. Raw gives the generated stub for anything else.
type Client struct {
	raw     pb.BrokerClient
	agent   *Agent
	retry   RetryPolicy
	mu      sync.Mutex
	keys    *BrokerKeys
	session *RenewingSession
}

// New is a Client over conn (a *grpc.ClientConn you dialed) signing as agent.
func New(conn grpc.ClientConnInterface, agent *Agent, opts ...Option) *Client {
	c := &Client{raw: pb.NewBrokerClient(conn), agent: agent, retry: DefaultRetryPolicy()}
	for _, o := range opts {
		o(c)
	}
	c.session = NewRenewingSession(c.raw, agent)
	return c
}

// Raw is the generated stub on the same connection (no signing, no session).
func (c *Client) Raw() pb.BrokerClient { return c.raw }

// Agent is the key this client signs and reads as.
func (c *Client) Agent() *Agent { return c.agent }

// Session is the client's read session.
func (c *Client) Session() *RenewingSession { return c.session }

// Keys returns the broker's published keys (fetched on first use).
func (c *Client) Keys(ctx context.Context) (*BrokerKeys, error) {
	c.mu.Lock()
	keys := c.keys
	c.mu.Unlock()
	if keys != nil {
		return keys, nil
	}
	return c.refreshKeys(ctx)
}

func (c *Client) refreshKeys(ctx context.Context) (*BrokerKeys, error) {
	keys, err := FetchBrokerKeys(ctx, c.raw)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.keys = keys
	c.mu.Unlock()
	return keys, nil
}

// verifyWith runs check with the known keys, and once more with freshly
// fetched ones when the object names a key not known yet (a rotation).
func verifyWith[T any](ctx context.Context, c *Client, check func(*BrokerKeys) (T, error)) (T, error) {
	keys, err := c.Keys(ctx)
	if err != nil {
		var zero T
		return zero, err
	}
	out, err := check(keys)
	if err == nil {
		return out, nil
	}
	fresh, ferr := c.refreshKeys(ctx)
	if ferr != nil || len(fresh.IDs()) == len(keys.IDs()) {
		return out, err
	}
	return check(fresh)
}

// Issued is a contract the broker issued, verified.
type Issued struct {
	*VerifiedContract
	// Replayed is true when the answer came from the broker's request log
	// (an earlier attempt with the same signed request had reached it).
	Replayed bool
}

// Receipt is a lifecycle call's verified receipt.
type Receipt struct {
	*VerifiedReceipt
	Replayed bool
}

// OpenRoot signs body (a fresh header unless it has one), sends it with
// CallIdempotent and verifies the root contract.
func (c *Client) OpenRoot(ctx context.Context, body *pb.OpenRootBody) (*Issued, error) {
	request, err := c.agent.OpenRoot(body)
	if err != nil {
		return nil, err
	}
	return c.SendOpenRoot(ctx, request)
}

// SendOpenRoot sends an OpenRoot request signed before (resent as it is).
func (c *Client) SendOpenRoot(ctx context.Context, request *pb.OpenRootRequest) (*Issued, error) {
	response, err := CallIdempotent(ctx, c.raw.OpenRoot, request, c.retry)
	if err != nil {
		return nil, err
	}
	return c.issued(ctx, response.GetIssued(), response.GetReplayed())
}

func (c *Client) issued(ctx context.Context, issued *pb.IssuedContract, replayed bool) (*Issued, error) {
	if issued == nil {
		return nil, verr(-1, "the answer carries no contract")
	}
	verified, err := verifyWith(ctx, c, func(k *BrokerKeys) (*VerifiedContract, error) {
		return VerifyContract(issued.GetContract(), k, issued.GetContractId())
	})
	if err != nil {
		return nil, err
	}
	return &Issued{VerifiedContract: verified, Replayed: replayed}, nil
}

// Delegate signs body as the parent's holder and sends it. An issued child
// is verified and returned; a refusal is a *BrokerError with Reason
// ReasonRefused, every violation (code, requested, allowed) and the
// verified signed refusal.
func (c *Client) Delegate(ctx context.Context, body *pb.DelegateBody) (*Issued, error) {
	request, err := c.agent.Delegate(body)
	if err != nil {
		return nil, err
	}
	return c.SendDelegate(ctx, request)
}

// SendDelegate sends a Delegate request signed before (resent as it is).
func (c *Client) SendDelegate(ctx context.Context, request *pb.DelegateRequest) (*Issued, error) {
	response, err := CallIdempotent(ctx, c.raw.Delegate, request, c.retry)
	if err != nil {
		return nil, err
	}
	if refused := response.GetRefused(); refused != nil {
		receipt, err := verifyWith(ctx, c, func(k *BrokerKeys) (*VerifiedReceipt, error) {
			return VerifyReceipt(refused.GetReceipt(), k, refused.GetReceiptId())
		})
		if err != nil {
			return nil, err
		}
		return nil, refusalError(receipt, response.GetReplayed())
	}
	return c.issued(ctx, response.GetIssued(), response.GetReplayed())
}

// receiptAnswer is what every lifecycle response carries.
type receiptAnswer interface {
	GetReceiptId() []byte
	GetReceipt() *pb.Sealed
	GetReplayed() bool
}

func lifecycle[Req proto.Message, Res receiptAnswer](ctx context.Context, c *Client, sign func(*Agent) (Req, error), call func(context.Context, Req, ...grpc.CallOption) (Res, error)) (*Receipt, error) {
	request, err := sign(c.agent)
	if err != nil {
		return nil, err
	}
	response, err := CallIdempotent(ctx, call, request, c.retry)
	if err != nil {
		return nil, err
	}
	verified, err := verifyWith(ctx, c, func(k *BrokerKeys) (*VerifiedReceipt, error) {
		return VerifyReceipt(response.GetReceipt(), k, response.GetReceiptId())
	})
	if err != nil {
		return nil, err
	}
	return &Receipt{VerifiedReceipt: verified, Replayed: response.GetReplayed()}, nil
}

// Accept accepts a contract this client's agent holds.
func (c *Client) Accept(ctx context.Context, body *pb.AcceptBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.AcceptRequest, error) { return a.Accept(body) }, c.raw.Accept)
}

// Decline declines a contract this client's agent holds.
func (c *Client) Decline(ctx context.Context, body *pb.DeclineBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.DeclineRequest, error) { return a.Decline(body) }, c.raw.Decline)
}

// Complete reports the result of a contract this client's agent holds; the
// receipt's Completion holds the broker's verdict.
func (c *Client) Complete(ctx context.Context, body *pb.CompleteBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.CompleteRequest, error) { return a.Complete(body) }, c.raw.Complete)
}

// Adjudicate records the principal's verdict on a contract pending it.
func (c *Client) Adjudicate(ctx context.Context, body *pb.AdjudicateBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.AdjudicateRequest, error) { return a.Adjudicate(body) }, c.raw.Adjudicate)
}

// Escalate returns a contract as unresolvable.
func (c *Client) Escalate(ctx context.Context, body *pb.EscalateBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.EscalateRequest, error) { return a.Escalate(body) }, c.raw.Escalate)
}

// Revoke revokes a contract and its open descendants.
func (c *Client) Revoke(ctx context.Context, body *pb.RevokeBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.RevokeRequest, error) { return a.Revoke(body) }, c.raw.Revoke)
}

// RecordReceipts records observations as the contract's host.
func (c *Client) RecordReceipts(ctx context.Context, body *pb.RecordReceiptsBody) (*Receipt, error) {
	return lifecycle(ctx, c, func(a *Agent) (*pb.RecordReceiptsRequest, error) { return a.RecordReceipts(body) }, c.raw.RecordReceipts)
}

// read runs one read with the session attached, once more with a renewed
// session when the broker no longer takes it (SESSION_EXPIRED, BAD_SESSION).
func read[Res any](ctx context.Context, c *Client, call func(context.Context) (Res, error)) (Res, error) {
	var zero Res
	for renewed := false; ; renewed = true {
		header, err := c.session.header(ctx, renewed)
		if err != nil {
			return zero, err
		}
		callCtx, cancel := withDefaultTimeout(metadata.AppendToOutgoingContext(ctx, SessionHeader, header), DefaultCallTimeout)
		response, err := call(callCtx)
		cancel()
		if err == nil {
			return response, nil
		}
		be := toBrokerError(err)
		if renewed || be.Code != codes.Unauthenticated || (be.Reason != "SESSION_EXPIRED" && be.Reason != "BAD_SESSION") {
			return zero, be
		}
	}
}

// GetChain reads the chain root → contractID and verifies it offline
// (VerifyChain), the leaf's id included.
func (c *Client) GetChain(ctx context.Context, contractID []byte) ([]*VerifiedContract, error) {
	response, err := read(ctx, c, func(ctx context.Context) (*pb.GetChainResponse, error) {
		return c.raw.GetChain(ctx, &pb.GetChainRequest{ContractId: contractID})
	})
	if err != nil {
		return nil, err
	}
	return verifyWith(ctx, c, func(k *BrokerKeys) ([]*VerifiedContract, error) {
		return VerifyGetChain(response, k, contractID)
	})
}

// GetContract reads one contract's state (status, ledger); its contract is
// verified on its own (VerifyContract).
func (c *Client) GetContract(ctx context.Context, contractID []byte) (*pb.ContractState, error) {
	response, err := read(ctx, c, func(ctx context.Context) (*pb.GetContractResponse, error) {
		return c.raw.GetContract(ctx, &pb.GetContractRequest{ContractId: contractID})
	})
	if err != nil {
		return nil, err
	}
	state := response.GetContract()
	if _, err := verifyWith(ctx, c, func(k *BrokerKeys) (*VerifiedContract, error) {
		return VerifyContract(state.GetContract(), k, contractID)
	}); err != nil {
		return nil, err
	}
	return state, nil
}

// GetReceipt reads a stored receipt and verifies it.
func (c *Client) GetReceipt(ctx context.Context, receiptID []byte) (*VerifiedReceipt, error) {
	response, err := read(ctx, c, func(ctx context.Context) (*pb.GetReceiptResponse, error) {
		return c.raw.GetReceipt(ctx, &pb.GetReceiptRequest{ReceiptId: receiptID})
	})
	if err != nil {
		return nil, err
	}
	return verifyWith(ctx, c, func(k *BrokerKeys) (*VerifiedReceipt, error) {
		return VerifyReceipt(response.GetReceipt(), k, receiptID)
	})
}

// GetAudit reads one contract's audit.
func (c *Client) GetAudit(ctx context.Context, contractID []byte) (*pb.ContractAudit, error) {
	response, err := read(ctx, c, func(ctx context.Context) (*pb.GetAuditResponse, error) {
		return c.raw.GetAudit(ctx, &pb.GetAuditRequest{ContractId: contractID})
	})
	if err != nil {
		return nil, err
	}
	return response.GetAudit(), nil
}

// AggregateAudits aggregates the audits of the runs whose labels match
// selector, grouped by the groupBy label keys (ratios of sums).
func (c *Client) AggregateAudits(ctx context.Context, selector map[string]string, groupBy ...string) ([]*pb.AuditGroup, error) {
	response, err := read(ctx, c, func(ctx context.Context) (*pb.AggregateAuditsResponse, error) {
		return c.raw.AggregateAudits(ctx, &pb.AggregateAuditsRequest{Selector: selector, GroupBy: groupBy})
	})
	if err != nil {
		return nil, err
	}
	return response.GetGroups(), nil
}
