# The two commands: `make demo` and `make test`. Both install what they need first.
# `make bench` runs the benchmark (BENCHMARKS.md); LEDGER_BENCH_SMOKE=1 makes it a smoke run.
# `make console` serves the operator console on the demo cluster (started first when needed) and
# prints its URL and a sign-in.
# `make package` builds the release archives, dist/ledger-<version>-pg<NN>-<arch>.tar.gz, one per
# PostgreSQL version (LEDGER_PG_VERSIONS="15" narrows it), and dist/SHA256SUMS.
.PHONY: demo demo-stop console test bootstrap bench package

demo:
	bash pgrx-tests/demo.sh

demo-stop:
	bash pgrx-tests/demo.sh stop

console:
	bash pgrx-tests/console.sh

test:
	bash pgrx-tests/test.sh

bootstrap:
	bash pgrx-tests/bootstrap.sh

bench:
	bash pgrx-tests/bench.sh

package: bootstrap
	bash pgrx-tests/package.sh
