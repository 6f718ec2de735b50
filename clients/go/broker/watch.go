package broker

import (
	"bytes"
	"context"
	"errors"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// WatchReconnects is how many times in a row, without an event in
	// between, a Watch reopens its stream before giving up.
	WatchReconnects = 10
	// MaxWatchSubtree bounds how many contract ids a Watch remembers to
	// check that each event belongs to the subtree.
	MaxWatchSubtree = 1 << 20
)

// WatchEvent is one verified event of a watched subtree: exactly one of
// Contract and Receipt is set.
type WatchEvent struct {
	// Cursor is the event's position in commit order; resume after it.
	Cursor   uint64
	ID       []byte
	Sealed   *pb.Sealed
	KeyID    string
	Contract *pb.Contract
	Receipt  *pb.Receipt
}

// Watch follows a contract's subtree: every event verified against the
// broker's keys, cursors strictly increasing, and — when it knows the
// subtree from its start (cursor 0) — every contract below one seen before
// and every receipt about one of them. It reopens the stream after the last
// cursor when it drops with UNAVAILABLE or ends (a broker shutting down).
// Not safe for concurrent use; end it by cancelling ctx.
type Watch struct {
	c          *Client
	contractID []byte
	cursor     uint64
	subtree    map[string]bool
	stream     pb.Broker_WatchClient
	cancel     context.CancelFunc
	failures   int
	// Streams counts the streams opened (1 + reconnections).
	Streams int
}

// Watch opens a watch of contractID's subtree after cursor (0: every stored
// event, oldest first, then live).
func (c *Client) Watch(contractID []byte, cursor uint64) *Watch {
	w := &Watch{c: c, contractID: append([]byte(nil), contractID...), cursor: cursor}
	if cursor == 0 {
		w.subtree = map[string]bool{string(contractID): true}
	}
	return w
}

// Cursor is the cursor of the last event returned (or the starting one).
func (w *Watch) Cursor() uint64 { return w.cursor }

// Close ends the current stream.
func (w *Watch) Close() {
	if w.cancel != nil {
		w.cancel()
		w.cancel, w.stream = nil, nil
	}
}

// Next returns the next verified event, waiting for it until ctx ends. A
// *VerificationError ends the watch (Close is called).
func (w *Watch) Next(ctx context.Context) (*WatchEvent, error) {
	for {
		if w.stream == nil {
			if err := w.open(ctx); err != nil {
				return nil, err
			}
		}
		response, err := w.stream.Recv()
		if err == nil {
			event, verr := w.verify(ctx, response)
			if verr != nil {
				w.Close()
				return nil, verr
			}
			w.cursor, w.failures = event.Cursor, 0
			return event, nil
		}
		w.Close()
		if ctx.Err() != nil {
			return nil, AsBrokerError(ctx.Err())
		}
		if !errors.Is(err, io.EOF) && toBrokerError(err).Code != codes.Unavailable {
			return nil, AsBrokerError(err)
		}
		if w.failures++; w.failures > WatchReconnects {
			return nil, AsBrokerError(err)
		}
		backoff := DefaultInitialBackoff << uint(w.failures-1)
		if backoff > DefaultMaxBackoff {
			backoff = DefaultMaxBackoff
		}
		select {
		case <-ctx.Done():
			return nil, AsBrokerError(ctx.Err())
		case <-time.After(backoff):
		}
	}
}

func (w *Watch) open(ctx context.Context) error {
	header, err := w.c.session.header(ctx, w.Streams > 0 && w.failures > 0)
	if err != nil {
		return err
	}
	streamCtx, cancel := context.WithCancel(ctx)
	stream, err := w.c.raw.Watch(metadata.AppendToOutgoingContext(streamCtx, SessionHeader, header), &pb.WatchRequest{ContractId: w.contractID, Cursor: w.cursor}, grpc.WaitForReady(false))
	if err != nil {
		cancel()
		return AsBrokerError(err)
	}
	w.Streams++
	w.stream, w.cancel = stream, cancel
	return nil
}

func (w *Watch) verify(ctx context.Context, response *pb.WatchResponse) (*WatchEvent, error) {
	if response.GetCursor() <= w.cursor {
		return nil, verr(-1, "cursor %d does not advance past %d", response.GetCursor(), w.cursor)
	}
	var event *WatchEvent
	var err error
	switch {
	case response.GetContract() != nil:
		event, err = verifyWith(ctx, w.c, func(k *BrokerKeys) (*WatchEvent, error) {
			v, err := VerifyContract(response.GetContract(), k, nil)
			if err != nil {
				return nil, err
			}
			return &WatchEvent{Cursor: response.GetCursor(), ID: v.ContractID, Sealed: v.Sealed, KeyID: v.KeyID, Contract: v.Contract}, nil
		})
	case response.GetReceipt() != nil:
		event, err = verifyWith(ctx, w.c, func(k *BrokerKeys) (*WatchEvent, error) {
			v, err := VerifyReceipt(response.GetReceipt(), k, nil)
			if err != nil {
				return nil, err
			}
			return &WatchEvent{Cursor: response.GetCursor(), ID: v.ReceiptID, Sealed: v.Sealed, KeyID: v.KeyID, Receipt: v.Receipt}, nil
		})
	default:
		return nil, verr(-1, "event at cursor %d is empty", response.GetCursor())
	}
	if err != nil {
		return nil, err
	}
	if w.subtree != nil {
		if event.Contract != nil {
			if !bytes.Equal(event.ID, w.contractID) && !w.subtree[string(event.Contract.GetParentId())] {
				return nil, verr(-1, "contract %x at cursor %d is outside the subtree", event.ID, event.Cursor)
			}
			if len(w.subtree) < MaxWatchSubtree {
				w.subtree[string(event.ID)] = true
			} else {
				w.subtree = nil // too large to follow: signatures are still checked
			}
		} else if !w.subtree[string(event.Receipt.GetContractId())] {
			return nil, verr(-1, "receipt %x at cursor %d is about a contract outside the subtree", event.ID, event.Cursor)
		}
	}
	return event, nil
}
