package broker

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// ErrorDomain is ErrorInfo.domain of every error the broker returns.
	ErrorDomain = "delegation.broker.v1"
	// ReasonRefused is this client's reason for a refused Delegate: not a
	// broker ErrorReason (a refusal is a normal, signed answer), so that a
	// refusal fails like any other call, with its violations.
	ReasonRefused = "REFUSED"
	// MaxErrorDetails bounds how many status details are decoded.
	MaxErrorDetails = 16
	// MaxErrorEntries bounds the metadata entries and field violations read.
	MaxErrorEntries = 64

	errorInfoType  = "type.googleapis.com/google.rpc.ErrorInfo"
	badRequestType = "type.googleapis.com/google.rpc.BadRequest"
)

// Violation is one violated invariant of a refused Delegate, with the values
// that violated it (types.proto's Violation table says what each holds).
type Violation struct {
	Code      pb.InvariantCode
	Requested string
	Allowed   string
	Detail    string
}

// FieldViolation is one entry of the google.rpc.BadRequest of an
// INVALID_FIELD error.
type FieldViolation struct {
	Field       string
	Description string
}

// BrokerError is every failure of a call to the broker: the gRPC code, and
// what the broker's google.rpc.ErrorInfo says — the stable Reason (an
// ErrorReason name without its prefix, e.g. "NONCE_REUSED"), the offending
// request Field, the Limit reached and the other metadata. Statuses the gRPC
// layer makes (a broker out of reach, a deadline) carry no ErrorInfo: Reason
// is then "" and Code alone says what happened. A refused Delegate is a
// BrokerError too, with Reason ReasonRefused, code FAILED_PRECONDITION, every
// violated invariant in Violations and the verified signed refusal in
// Refusal. Act on Reason and Code, never on Message.
//
//	var be *broker.BrokerError
//	if errors.As(err, &be) && be.Reason == "NOT_FOUND" { ... }
type BrokerError struct {
	Code            codes.Code
	Message         string
	Reason          string
	Field           string
	Limit           string
	Metadata        map[string]string
	FieldViolations []FieldViolation
	Violations      []Violation
	Refusal         *VerifiedReceipt
	// Replayed is true for a refusal answered from the broker's request log.
	Replayed bool
	cause    error
}

func (e *BrokerError) Error() string {
	var b strings.Builder
	b.WriteString("broker: ")
	b.WriteString(CodeName(e.Code))
	if e.Reason != "" {
		b.WriteString(" (" + e.Reason + ")")
	}
	if e.Message != "" {
		b.WriteString(": " + e.Message)
	}
	for _, v := range e.Violations {
		fmt.Fprintf(&b, "; %s requested %s allowed %s", InvariantName(v.Code), v.Requested, v.Allowed)
	}
	return b.String()
}

// Unwrap returns the gRPC status error (or context error) it came from.
func (e *BrokerError) Unwrap() error { return e.cause }

// GRPCStatus makes status.FromError and status.Code work on it.
func (e *BrokerError) GRPCStatus() *status.Status {
	if st, ok := status.FromError(e.cause); ok && e.cause != nil {
		return st
	}
	return status.New(e.Code, e.Message)
}

// Codes lists the violated invariants' codes, in the broker's order.
func (e *BrokerError) Codes() []pb.InvariantCode {
	out := make([]pb.InvariantCode, 0, len(e.Violations))
	for _, v := range e.Violations {
		out = append(out, v.Code)
	}
	return out
}

// CodeName is a gRPC code's name as the other clients print it, e.g.
// "PERMISSION_DENIED".
func CodeName(c codes.Code) string {
	if c == codes.Canceled {
		return "CANCELLED"
	}
	name := c.String()
	var b strings.Builder
	for i, r := range name {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}

// InvariantName is an invariant code without its prefix, e.g.
// "NO_RETRY_HEADROOM".
func InvariantName(c pb.InvariantCode) string {
	return strings.TrimPrefix(c.String(), "INVARIANT_CODE_")
}

// AsBrokerError turns any error of a call into a *BrokerError (nil stays
// nil, a *BrokerError is returned as it is).
func AsBrokerError(err error) error {
	if err == nil {
		return nil
	}
	return toBrokerError(err)
}

// toBrokerError is AsBrokerError for a non-nil err, typed.
func toBrokerError(err error) *BrokerError {
	var be *BrokerError
	if errors.As(err, &be) {
		return be
	}
	out := &BrokerError{cause: err, Metadata: map[string]string{}}
	st, ok := status.FromError(err)
	switch {
	case ok:
		out.Code, out.Message = st.Code(), st.Message()
	case errors.Is(err, context.DeadlineExceeded):
		out.Code, out.Message = codes.DeadlineExceeded, err.Error()
	case errors.Is(err, context.Canceled):
		out.Code, out.Message = codes.Canceled, err.Error()
	default:
		out.Code, out.Message = codes.Unknown, err.Error()
	}
	if ok {
		details := st.Proto().GetDetails()
		if len(details) > MaxErrorDetails {
			details = details[:MaxErrorDetails]
		}
		infoFound := false
		for _, d := range details {
			switch d.GetTypeUrl() {
			case errorInfoType:
				reason, domain, metadata := decodeErrorInfo(d.GetValue())
				if infoFound && domain != ErrorDomain {
					continue
				}
				infoFound = true
				out.Reason, out.Metadata = reason, metadata
			case badRequestType:
				out.FieldViolations = decodeBadRequest(d.GetValue())
			}
		}
		out.Field, out.Limit = out.Metadata["field"], out.Metadata["limit"]
	}
	return out
}

// The two google.rpc detail messages are read with protowire, so this
// module needs no genproto package of its own (which modules carry
// google.golang.org/genproto/googleapis/rpc changed over time; a
// requirement on either would break builds that pick the other).

func fields(b []byte, each func(num protowire.Number, typ protowire.Type, value []byte) bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		var value []byte
		if typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return
			}
			value, n = v, m
		} else {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return
			}
		}
		b = b[n:]
		if !each(num, typ, value) {
			return
		}
	}
}

func decodeErrorInfo(b []byte) (reason, domain string, metadata map[string]string) {
	metadata = map[string]string{}
	fields(b, func(num protowire.Number, typ protowire.Type, value []byte) bool {
		if typ != protowire.BytesType {
			return true
		}
		switch num {
		case 1:
			reason = string(value)
		case 2:
			domain = string(value)
		case 3:
			if len(metadata) >= MaxErrorEntries {
				return false
			}
			var k, v string
			fields(value, func(n protowire.Number, t protowire.Type, val []byte) bool {
				if t == protowire.BytesType && n == 1 {
					k = string(val)
				} else if t == protowire.BytesType && n == 2 {
					v = string(val)
				}
				return true
			})
			metadata[k] = v
		}
		return true
	})
	return reason, domain, metadata
}

func decodeBadRequest(b []byte) []FieldViolation {
	var out []FieldViolation
	fields(b, func(num protowire.Number, typ protowire.Type, value []byte) bool {
		if num != 1 || typ != protowire.BytesType {
			return true
		}
		if len(out) >= MaxErrorEntries {
			return false
		}
		var fv FieldViolation
		fields(value, func(n protowire.Number, t protowire.Type, val []byte) bool {
			if t == protowire.BytesType && n == 1 {
				fv.Field = string(val)
			} else if t == protowire.BytesType && n == 2 {
				fv.Description = string(val)
			}
			return true
		})
		out = append(out, fv)
		return true
	})
	return out
}

func refusalError(refusal *VerifiedReceipt, replayed bool) *BrokerError {
	r := refusal.Receipt
	violations := make([]Violation, 0, len(r.GetViolations()))
	for _, v := range r.GetViolations() {
		violations = append(violations, Violation{Code: v.GetCode(), Requested: v.GetRequested(), Allowed: v.GetAllowed(), Detail: v.GetDetail()})
	}
	return &BrokerError{
		Code:       codes.FailedPrecondition,
		Message:    "the broker refused the delegation: " + InvariantName(r.GetPrimary()),
		Reason:     ReasonRefused,
		Metadata:   map[string]string{},
		Violations: violations,
		Refusal:    refusal,
		Replayed:   replayed,
	}
}
