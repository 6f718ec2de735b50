// Command first_delegation opens a root, delegates one hop and verifies the
// chain offline: the Go client's first delegation.
//
//	go run ./examples/first_delegation -addr 127.0.0.1:50051 -key-file orchestrator.key
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const timeout = 30 * time.Second

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "broker address, host:port")
	keyFile := flag.String("key-file", "", "the orchestrator's key (as `delegation-broker keygen` writes it); default: a fresh one")
	flag.Parse()
	if err := run(context.Background(), *addr, *keyFile, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "first_delegation:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, keyFile string, out io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	orchestrator, err := broker.GenerateAgent()
	if keyFile != "" {
		orchestrator, err = broker.LoadKeyFile(keyFile)
	}
	if err != nil {
		return err
	}
	planner, err := broker.GenerateAgent()
	if err != nil {
		return err
	}
	conn, err := grpc.DialContext(ctx, addr, grpc.WithInsecure())
	if err != nil {
		return err
	}
	defer conn.Close()
	client := broker.New(conn, orchestrator)

	root, err := client.OpenRoot(ctx, &pb.OpenRootBody{
		Intent: "fix the token refresh bug", Budget: 100, DeadlineMs: broker.NowMs() + 3_600_000,
		Policy: &pb.Policy{MaxDepth: 3, MaxChildren: 4}, WriteScope: []string{"src"},
	})
	if err != nil {
		return err
	}
	child, err := client.Delegate(ctx, &pb.DelegateBody{
		ParentId: root.ContractID, IntentLineageHash: root.Contract.IntentLineageHash,
		Task: "plan the fix", DelegatePublicKey: planner.PublicKey(), Budget: 500,
		Liability: pb.Liability_LIABILITY_PRINCIPAL, WriteScope: []string{"src/auth"},
	})
	var refused *broker.BrokerError
	if errors.As(err, &refused) && refused.Reason == broker.ReasonRefused {
		for _, v := range refused.Violations { // BUDGET_EXCEEDS_PARENT: requested 500, allowed 100
			fmt.Fprintf(out, "refused: %s (requested %s, allowed %s)\n", broker.InvariantName(v.Code), v.Requested, v.Allowed)
		}
		child, err = client.Delegate(ctx, &pb.DelegateBody{
			ParentId: root.ContractID, IntentLineageHash: root.Contract.IntentLineageHash,
			Task: "plan the fix", DelegatePublicKey: planner.PublicKey(), Budget: 40,
			Liability: pb.Liability_LIABILITY_PRINCIPAL, WriteScope: []string{"src/auth"},
		})
	}
	if err != nil {
		return err
	}
	chain, err := client.GetChain(ctx, child.ContractID) // verified offline against GetBrokerKeys
	if err != nil {
		return err
	}
	for _, c := range chain {
		fmt.Fprintf(out, "depth %d: budget %d, trust %d ppm, signed by %s\n", c.Contract.Depth, c.Contract.Budget, c.Contract.CumulativeTrustPpm, c.KeyID)
	}
	fmt.Fprintf(out, "verified a chain of %d contracts\n", len(chain))
	return nil
}
