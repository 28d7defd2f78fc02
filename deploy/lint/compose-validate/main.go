// compose-validate: what `docker compose config` does to a Compose file, without Docker: it
// loads the file with compose-go (the loader Docker Compose v2 itself uses): the Compose
// Specification's JSON schema, variable interpolation, extends/anchors/merge, normalisation
// and the consistency checks (unknown services in depends_on, undefined volumes/networks).
// Prints the resolved model as YAML; exits 1 with the loader's message on any error.
//
// Usage: compose-validate [-profile NAME]... FILE
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/compose-spec/compose-go/v2/cli"
)

type profiles []string

func (p *profiles) String() string     { return fmt.Sprint(*p) }
func (p *profiles) Set(v string) error { *p = append(*p, v); return nil }

func main() {
	var prof profiles
	flag.Var(&prof, "profile", "enable this profile (repeatable)")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: compose-validate [-profile NAME]... FILE")
		os.Exit(2)
	}
	file, err := filepath.Abs(flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	opts, err := cli.NewProjectOptions([]string{file},
		cli.WithWorkingDirectory(filepath.Dir(file)),
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithConsistency(true),
		cli.WithProfiles(prof),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-validate:", err)
		os.Exit(1)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-validate:", err)
		os.Exit(1)
	}
	out, err := project.MarshalYAML()
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-validate:", err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}
