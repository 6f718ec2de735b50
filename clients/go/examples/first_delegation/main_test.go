package main

import (
	"bytes"
	"context"
	"regexp"
	"testing"

	"github.com/delegation-broker/delegation-broker/clients/go/internal/brokertest"
)

// The README's first delegation, against a real broker.
func TestFirstDelegation(t *testing.T) {
	b := brokertest.Start(t)
	var out bytes.Buffer
	if err := run(context.Background(), b.Address, "", &out); err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(`^refused: BUDGET_EXCEEDS_PARENT \(requested 500, allowed 100\)
depth 0: budget 100, trust 1000000 ppm, signed by ed25519:[0-9a-f]{32}
depth 1: budget 40, trust 0 ppm, signed by ed25519:[0-9a-f]{32}
verified a chain of 2 contracts
$`)
	if !want.Match(out.Bytes()) {
		t.Fatalf("printed:\n%s", out.String())
	}
}
