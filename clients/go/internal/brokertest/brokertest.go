// Package brokertest starts the real broker binary ($BROKER_BIN) for tests:
// a fresh broker per test on 127.0.0.1:0, with its own data directory and a
// config trusting one attestor and one reader.
package brokertest

import (
	"bufio"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/delegation-broker/delegation-broker/clients/go/broker"
)

const (
	// StartTimeout bounds how long the broker may take to print its address.
	StartTimeout = 30 * time.Second
	// StopTimeout bounds the graceful drain before SIGKILL.
	StopTimeout = 10 * time.Second
	// signalGrace: the broker installs its SIGTERM handler shortly after it
	// prints its address.
	signalGrace = 500 * time.Millisecond
)

// Broker is one running broker.
type Broker struct {
	Address  string
	Dir      string
	Attestor *broker.Agent
	Reader   *broker.Agent
	cmd      *exec.Cmd
	started  time.Time
}

// Bin is $BROKER_BIN; a test fails when it is not set.
func Bin(t testing.TB) string {
	bin := os.Getenv("BROKER_BIN")
	if bin == "" {
		t.Fatal("BROKER_BIN is not set: clients/go/run-tests.sh sets it (the broker binary these tests start)")
	}
	return bin
}

// RepoRoot is the repository's root ($REPO_ROOT, else two levels above the
// module).
func RepoRoot(t testing.TB) string {
	if root := os.Getenv("REPO_ROOT"); root != "" {
		return root
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for dir := wd; dir != "/"; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "testdata", "signing-vectors.json")); err == nil {
			return dir
		}
	}
	t.Fatal("REPO_ROOT is not set and no testdata/signing-vectors.json above " + wd)
	return ""
}

// Start starts a broker for t, stopped when t ends.
func Start(t testing.TB) *Broker {
	t.Helper()
	attestor, err := broker.GenerateAgent()
	if err != nil {
		t.Fatal(err)
	}
	reader, err := broker.GenerateAgent()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	config := fmt.Sprintf("[trust]\nattestors = [%q]\n\n[readers]\nkeys = [%q]\n", hex.EncodeToString(attestor.PublicKey()), hex.EncodeToString(reader.PublicKey()))
	configPath := filepath.Join(dir, "broker.toml")
	if err := os.WriteFile(configPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(dir, "broker.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(Bin(t), "serve", "--listen", "127.0.0.1:0", "--data-dir", filepath.Join(dir, "data"), "--config", configPath)
	cmd.Env = append(os.Environ(), "BROKER_LOG=warn")
	cmd.Stderr = logFile
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	b := &Broker{Dir: dir, Attestor: attestor, Reader: reader, cmd: cmd, started: time.Now()}
	t.Cleanup(func() { b.stop(); logFile.Close() })
	lines := make(chan string, 1)
	go func() {
		scanner := bufio.NewScanner(stdout)
		first := true
		for scanner.Scan() { // keep reading so the broker never blocks on stdout
			if first {
				lines <- scanner.Text()
				first = false
			}
		}
		if first {
			close(lines)
		}
	}()
	select {
	case line, ok := <-lines:
		const prefix = "listening on "
		if !ok || !strings.HasPrefix(line, prefix) {
			log, _ := os.ReadFile(filepath.Join(dir, "broker.log"))
			t.Fatalf("broker did not start (first line %q); log:\n%s", line, log)
		}
		b.Address = strings.TrimSpace(strings.TrimPrefix(line, prefix))
	case <-time.After(StartTimeout):
		t.Fatalf("broker printed no address within %s", StartTimeout)
	}
	return b
}

func (b *Broker) stop() {
	if b.cmd.Process == nil {
		return
	}
	if wait := signalGrace - time.Since(b.started); wait > 0 {
		time.Sleep(wait)
	}
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = b.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(StopTimeout):
		_ = b.cmd.Process.Kill()
		<-done
	}
}

// Dial connects to the broker (plaintext), closed when t ends.
func (b *Broker) Dial(t testing.TB, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), StartTimeout)
	defer cancel()
	conn, err := grpc.DialContext(ctx, b.Address, append([]grpc.DialOption{grpc.WithInsecure(), grpc.WithBlock()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Client is a broker.Client signing as agent.
func (b *Broker) Client(t testing.TB, agent *broker.Agent, opts ...grpc.DialOption) *broker.Client {
	return broker.New(b.Dial(t, opts...), agent)
}

// Agent generates a key, failing t on error.
func Agent(t testing.TB) *broker.Agent {
	a, err := broker.GenerateAgent()
	if err != nil {
		t.Fatal(err)
	}
	return a
}
