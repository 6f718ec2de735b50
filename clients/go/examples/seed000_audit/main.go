// Command seed000_audit reports seed 000's delegation audit from a broker:
// AggregateAudits grouped by arm (or other labels), printed as the table of
// ratios of sums `delegation-broker audit` prints, and with -contract the
// audit of one contract (GetAudit) field by field, as seed 000's
// DelegationAudit holds it.
//
//	go run ./examples/seed000_audit -addr 127.0.0.1:50051 -key-file reader.key -group-by arm
//
// A rate is a ratio of sums over the group (Σ discovered / Σ evidence, ...),
// never an average of per-run rates: averaging would weight a child that
// read two files like one that read forty. The key file is what
// `delegation-broker keygen` writes; a key listed under [readers] sees every
// run, any other key the runs whose root it opened.
package main

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
	pb "github.com/delegation-broker/delegation-broker/clients/go/gen/delegation/broker/v1"
)

const (
	// callTimeout bounds the whole report.
	callTimeout = 30 * time.Second
	// rateTolerance: a broker rate and the ratio of its sums may differ by
	// floating-point rounding only.
	rateTolerance = 1e-12
)

type labels []string

func (l *labels) String() string     { return strings.Join(*l, ",") }
func (l *labels) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "seed000_audit:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	flags := flag.NewFlagSet("seed000_audit", flag.ContinueOnError)
	addr := flags.String("addr", "127.0.0.1:50051", "broker address, host:port")
	keyFile := flags.String("key-file", "", "the key to read as (a hex seed, as `delegation-broker keygen` writes it)")
	contract := flags.String("contract", "", "also print the audit of this contract (hex id)")
	var groupBy, selectors labels
	flags.Var(&groupBy, "group-by", "label key to group runs by (repeatable; default arm)")
	flags.Var(&selectors, "select", "only runs with this label, key=value (repeatable)")
	if err := flags.Parse(args); err != nil {
		return err
	}
	if *keyFile == "" {
		return errors.New("-key-file is required")
	}
	if len(groupBy) == 0 {
		groupBy = labels{"arm"}
	}
	selector := map[string]string{}
	for _, s := range selectors {
		k, v, ok := strings.Cut(s, "=")
		if !ok {
			return fmt.Errorf("-select %q is not key=value", s)
		}
		selector[k] = v
	}
	agent, err := broker.LoadKeyFile(*keyFile)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	conn, err := grpc.DialContext(ctx, *addr, grpc.WithInsecure())
	if err != nil {
		return err
	}
	defer conn.Close()
	client := broker.New(conn, agent)

	groups, err := client.AggregateAudits(ctx, selector, groupBy...)
	if err != nil {
		return err
	}
	if err := checkRatios(groups); err != nil {
		return err
	}
	if _, err := io.WriteString(out, Table(groups, groupBy)); err != nil {
		return err
	}
	if *contract != "" {
		id, err := hex.DecodeString(*contract)
		if err != nil {
			return fmt.Errorf("-contract: %w", err)
		}
		audit, err := client.GetAudit(ctx, id)
		if err != nil {
			return err
		}
		_, err = io.WriteString(out, "\n"+ContractReport(audit))
		return err
	}
	return nil
}

// ratio is a/b, or nil when b is 0.
func ratio(a, b float64) *float64 {
	if b == 0 {
		return nil
	}
	r := a / b
	return &r
}

// checkRatios holds the broker to seed 000's rule: each rate is the ratio
// of the group's sums.
func checkRatios(groups []*pb.AuditGroup) error {
	for _, g := range groups {
		for _, c := range []struct {
			name     string
			got      *float64
			num, den float64
		}{
			{"discovery_rate", g.DiscoveryRate, float64(g.GetDiscoveredPaths()), float64(g.GetEvidencePaths())},
			{"false_completion_rate", g.FalseCompletionRate, float64(g.GetFalseCompletions()), float64(g.GetWithReport())},
			{"claim_violations_per_mutation", g.ClaimViolationsPerMutation, float64(g.GetClaimViolations()), float64(g.GetMutations())},
			{"spent_over_granted", g.SpentOverGranted, float64(g.GetBudgetSpent()), float64(g.GetBudgetGranted())},
		} {
			want := ratio(c.num, c.den)
			if (want == nil) != (c.got == nil) || (want != nil && math.Abs(*want-*c.got) > rateTolerance) {
				return fmt.Errorf("group %v: %s is not the ratio of its sums", g.GetKey(), c.name)
			}
		}
	}
	return nil
}

func rate(r *float64) string {
	if r == nil {
		return "-"
	}
	return fmt.Sprintf("%.3f", *r)
}

func refusals(g *pb.AuditGroup) string {
	if len(g.GetRefusalsByCode()) == 0 {
		return "-"
	}
	codes := make([]string, 0, len(g.GetRefusalsByCode()))
	for code := range g.GetRefusalsByCode() {
		codes = append(codes, code)
	}
	sort.Strings(codes)
	parts := make([]string, 0, len(codes))
	for _, code := range codes {
		parts = append(parts, fmt.Sprintf("%s:%d", code, g.GetRefusalsByCode()[code]))
	}
	return strings.Join(parts, " ")
}

// Table renders groups as aligned columns, each ratio beside its sums.
func Table(groups []*pb.AuditGroup, groupBy []string) string {
	rows := [][]string{{"group", "runs", "contracts", "discovery", "false compl.", "violations/mut", "conflicts", "escalations", "refusals", "spent/granted"}}
	for _, g := range groups {
		key := "(all)"
		if len(groupBy) > 0 {
			parts := make([]string, 0, len(groupBy))
			for _, k := range groupBy {
				parts = append(parts, k+"="+g.GetKey()[k])
			}
			key = strings.Join(parts, " ")
		}
		rows = append(rows, []string{
			key,
			fmt.Sprint(g.GetRuns()),
			fmt.Sprint(g.GetContracts()),
			fmt.Sprintf("%d/%d = %s", g.GetDiscoveredPaths(), g.GetEvidencePaths(), rate(g.DiscoveryRate)),
			fmt.Sprintf("%d/%d = %s", g.GetFalseCompletions(), g.GetWithReport(), rate(g.FalseCompletionRate)),
			fmt.Sprintf("%d/%d = %s", g.GetClaimViolations(), g.GetMutations(), rate(g.ClaimViolationsPerMutation)),
			fmt.Sprint(g.GetConflicts()),
			fmt.Sprint(g.GetEscalations()),
			refusals(g),
			fmt.Sprintf("%d/%d = %s", g.GetBudgetSpent(), g.GetBudgetGranted(), rate(g.SpentOverGranted)),
		})
	}
	widths := make([]int, len(rows[0]))
	for _, row := range rows {
		for i, cell := range row {
			if n := len([]rune(cell)); n > widths[i] {
				widths[i] = n
			}
		}
	}
	var b strings.Builder
	for r, row := range rows {
		cells := make([]string, len(row))
		for i, cell := range row {
			cells[i] = cell + strings.Repeat(" ", widths[i]-len([]rune(cell)))
		}
		b.WriteString(strings.TrimRight(strings.Join(cells, "  "), " ") + "\n")
		if r == 0 {
			dashes := make([]string, len(widths))
			for i, w := range widths {
				dashes[i] = strings.Repeat("-", w)
			}
			b.WriteString(strings.Join(dashes, "  ") + "\n")
		}
	}
	return b.String()
}

// ContractReport prints one contract's audit, seed 000's DelegationAudit
// fields first: host-observed counts, never the delegate's claim folded in.
func ContractReport(a *pb.ContractAudit) string {
	var b strings.Builder
	fmt.Fprintf(&b, "contract %x depth %d\n", a.GetContractId(), a.GetDepth())
	fmt.Fprintf(&b, "  tool calls %d, mutations %d (%d paths), claim violations %d\n", a.GetToolCalls(), a.GetMutations(), a.GetMutationPathCount(), a.GetClaimViolations())
	fmt.Fprintf(&b, "  has report %v, downgrades %d, false completion %v\n", a.GetHasReport(), a.GetDowngrades(), a.GetFalseCompletion())
	fmt.Fprintf(&b, "  parent named %d files and %d scope hints; evidence paths %d, discovered %d\n", a.GetParentNamedFiles(), a.GetParentScopeHints(), a.GetEvidencePaths(), a.GetDiscoveredPaths())
	fmt.Fprintf(&b, "  verdict %s, claim %q\n", strings.TrimPrefix(a.GetVerdict().String(), "VERDICT_"), a.GetClaim())
	return b.String()
}
