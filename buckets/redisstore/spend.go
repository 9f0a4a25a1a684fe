package redisstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/tokengate/tokengate/buckets"
)

var _ buckets.SpendAdder = (*Store)(nil)

// AddSpend implements buckets.SpendAdder: one settle op per group (hash
// slot) of the spends' windows, without a record, that applies once per
// id and group by its marker key, as a replay does (see batchLua),
// changing each window's spend by its amount.
func (s *Store) AddSpend(ctx context.Context, id string, ss []buckets.Spend) error {
	if err := buckets.ValidateSpend(id, ss); err != nil {
		return err
	}
	ctx, cancel, err := s.start(ctx, "add spend")
	if err != nil {
		return err
	}
	defer cancel()
	qs, spans := make([]buckets.Quota, len(ss)), make([]buckets.Span, len(ss))
	for j, sp := range ss {
		qs[j], spans[j] = sp.Quota, sp.Window
	}
	qdelta := func(j int) float64 { return ss[j].Amount }
	gs := s.groups(nil, nil, qs)
	ops := make([]op, len(gs))
	now := s.now()
	for k, g := range gs {
		ops[k] = op{g: g, id: idPart(id), qs: qs, spans: spans, qdelta: qdelta,
			marker: s.prefix + "s:{" + g.tag + "}:" + idPart(id), markTTL: markTTL(g, spans, now)}
	}
	eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	var errs []error
	for k := range ops {
		if err := ops[k].err; err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("redisstore: add spend: %w", err)
	}
	return nil
}
