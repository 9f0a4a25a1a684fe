package extproc

import "testing"

// BenchmarkRewriteBody: the include_usage rewrite of the 1 KB chat request
// the decision path benchmark sends.
func BenchmarkRewriteBody(b *testing.B) {
	c := counted(b, chatPath, benchBody)
	body := []byte(benchBody)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := rewriteBody(c, body, true, 0); err != nil {
			b.Fatal(err)
		}
	}
}
