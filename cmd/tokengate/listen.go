package main

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"

	"github.com/tokengate/tokengate/config"
)

// listen opens a listener's address: host:port over TCP, or unix:PATH as a
// unix socket. A socket file that a process which ended left behind is
// removed first, as nothing answers on it any more; one that answers is in
// use, and any other file is not ours to remove. A unix listener removes
// its file when it closes.
func listen(addr string) (net.Listener, error) {
	path, ok := config.UnixSocket(addr)
	if !ok {
		return net.Listen("tcp", addr)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a unix socket; it is left alone", path)
		}
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: another process listens on this socket", path)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("%s: removing the socket a process left behind: %w", path, err)
		}
	}
	return net.Listen("unix", path)
}
