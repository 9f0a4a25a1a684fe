package redistest

import (
	"strings"
	"testing"
)

func TestStartKillRestart(t *testing.T) {
	s := Start(t)
	if _, err := Do(s.Addr, "SET", "k", "v"); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := Do(s.Addr, "GET", "k"); err != nil || got != "v" {
		t.Fatalf("GET k = %q, %v; want v", got, err)
	}
	s.Kill()
	if _, err := Do(s.Addr, "PING"); err == nil {
		t.Fatal("PING after Kill succeeded; want a connection error")
	}
	s.Restart()
	if got, err := Do(s.Addr, "PING"); err != nil || got != "PONG" {
		t.Fatalf("PING after Restart = %q, %v; want PONG", got, err)
	}
}

func TestStartCluster(t *testing.T) {
	c := StartCluster(t)
	if len(c.Addrs) != 3 {
		t.Fatalf("cluster has %d masters, want 3", len(c.Addrs))
	}
	info, err := Do(c.Addrs[0], "CLUSTER", "INFO")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(info, "cluster_slots_assigned:16384") {
		t.Errorf("CLUSTER INFO does not report all slots assigned:\n%s", info)
	}
}
