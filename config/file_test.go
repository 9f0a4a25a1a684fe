package config

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A configuration file above MaxFileBytes is refused before it is parsed,
// with a message naming the file and the limit; one at the limit is read.
func TestReadFileBounded(t *testing.T) {
	dir := t.TempDir()
	at := filepath.Join(dir, "at.yaml")
	over := filepath.Join(dir, "over.yaml")
	if err := os.WriteFile(at, bytes.Repeat([]byte("#"), MaxFileBytes), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(over, bytes.Repeat([]byte("#"), MaxFileBytes+1), 0o644); err != nil {
		t.Fatal(err)
	}
	data, err := ReadFile(at)
	if err != nil || len(data) != MaxFileBytes {
		t.Errorf("ReadFile(%d bytes) = %d bytes, %v; want it whole", MaxFileBytes, len(data), err)
	}
	_, err = ReadFile(over)
	if err == nil || !strings.Contains(err.Error(), over) || !strings.Contains(err.Error(), "larger than 8 MiB") {
		t.Errorf("ReadFile(one byte over) = %v, want an error naming the file and the limit", err)
	}
	if _, err := Load(over); err == nil {
		t.Error("Load of a file over the limit succeeded")
	}
}
