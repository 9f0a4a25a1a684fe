// Package charts holds no code: its tests render the Helm charts in this
// directory (charts/tokengate) with Helm's own library, decode every
// manifest strictly into the Kubernetes API types, and validate the
// tokengate configuration each one carries with the tokengate binary.
package charts
