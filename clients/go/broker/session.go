package broker

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

// ReadSession is a session the broker issued: the Sealed to send with reads
// and what it says (decoded, not verified: the broker verifies it at every
// read; VerifySealed(s.Sealed, keys, &pb.Session{}) verifies it offline).
type ReadSession struct {
	Sealed         *pb.Sealed
	AgentPublicKey []byte
	IssuedAtMs     int64
	ExpiresAtMs    int64
	header         string
}

// Lifetime is how long the broker accepts it.
func (s *ReadSession) Lifetime() time.Duration {
	if ms := s.ExpiresAtMs - s.IssuedAtMs; ms > 0 {
		return time.Duration(ms) * time.Millisecond
	}
	return 0
}

// OpenSession asks the broker for its current key id, then opens a session
// for agent with a freshly signed request. Every call opens a new one.
func OpenSession(ctx context.Context, client pb.BrokerClient, agent *Agent) (*ReadSession, error) {
	ctx, cancel := withDefaultTimeout(ctx, DefaultCallTimeout)
	defer cancel()
	keys, err := client.GetBrokerKeys(ctx, &pb.GetBrokerKeysRequest{})
	if err != nil {
		return nil, AsBrokerError(err)
	}
	current := ""
	for _, k := range keys.GetKeys() {
		if k.GetCurrent() {
			current = k.GetKeyId()
		}
	}
	if current == "" {
		return nil, verr(-1, "the broker published no current key")
	}
	request, err := agent.OpenSession(&pb.OpenSessionBody{BrokerKeyId: current})
	if err != nil {
		return nil, err
	}
	response, err := client.OpenSession(ctx, request)
	if err != nil {
		return nil, AsBrokerError(err)
	}
	sealed := response.GetSession()
	session := &pb.Session{}
	if sealed == nil || proto.Unmarshal(sealed.GetPayload(), session) != nil {
		return nil, verr(-1, "the OpenSession answer carries no session")
	}
	encoded, err := proto.Marshal(sealed)
	if err != nil {
		return nil, err
	}
	expires := response.GetExpiresAtMs()
	if expires == 0 {
		expires = session.GetExpiresAtMs()
	}
	return &ReadSession{Sealed: sealed, AgentPublicKey: session.GetAgentPublicKey(), IssuedAtMs: session.GetIssuedAtMs(), ExpiresAtMs: expires, header: string(encoded)}, nil
}

// RenewingSession is agent's read session, opened when first needed and
// again on the first read after RenewAt of its lifetime (counted by this
// machine's clock from when it was asked for, so clock skew does not
// matter), or when the broker refuses it. Nothing runs in the background.
type RenewingSession struct {
	client    pb.BrokerClient
	agent     *Agent
	mu        sync.Mutex
	session   *ReadSession
	renewFrom time.Time
}

// NewRenewingSession is agent's session on the broker behind client (used
// only for GetBrokerKeys and OpenSession).
func NewRenewingSession(client pb.BrokerClient, agent *Agent) *RenewingSession {
	return &RenewingSession{client: client, agent: agent}
}

// Current returns the session to send now, opening one first if needed.
func (r *RenewingSession) Current(ctx context.Context) (*ReadSession, error) {
	return r.get(ctx, false)
}

func (r *RenewingSession) get(ctx context.Context, renew bool) (*ReadSession, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !renew && r.session != nil && time.Now().Before(r.renewFrom) {
		return r.session, nil
	}
	asked := time.Now()
	session, err := OpenSession(ctx, r.client, r.agent)
	if err != nil {
		return nil, err
	}
	r.session = session
	r.renewFrom = asked.Add(time.Duration(float64(session.Lifetime()) * RenewAt))
	return session, nil
}

func (r *RenewingSession) header(ctx context.Context, renew bool) (string, error) {
	s, err := r.get(ctx, renew)
	if err != nil {
		return "", err
	}
	return s.header, nil
}

// publicMethods never carry a session.
var publicMethods = map[string]bool{
	"/delegation.broker.v1.Broker/OpenSession":   true,
	"/delegation.broker.v1.Broker/GetBrokerKeys": true,
}

// Interceptors add the session to every call of a connection but the public
// OpenSession and GetBrokerKeys, for code that calls the generated stub:
// grpc.Dial(addr, grpc.WithChainUnaryInterceptor(u), grpc.WithChainStreamInterceptor(s)).
func (r *RenewingSession) Interceptors() (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor) {
	attach := func(ctx context.Context, method string) (context.Context, error) {
		if publicMethods[method] {
			return ctx, nil
		}
		if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get(SessionHeader)) > 0 {
			return ctx, nil
		}
		header, err := r.header(ctx, false)
		if err != nil {
			return nil, err
		}
		return metadata.AppendToOutgoingContext(ctx, SessionHeader, header), nil
	}
	unary := func(ctx context.Context, method string, req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		ctx, err := attach(ctx, method)
		if err != nil {
			return err
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	stream := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		ctx, err := attach(ctx, method)
		if err != nil {
			return nil, err
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
	return unary, stream
}
