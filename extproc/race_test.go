//go:build race

package extproc

// raceEnabled: the race detector slows the tokenizer tenfold; benchmarks
// that `make test` runs once under it keep their inputs small.
const raceEnabled = true
