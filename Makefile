# The two commands: `make demo` and `make test`. Both install what they need first.
.PHONY: demo demo-stop test bootstrap

demo:
	bash pgrx-tests/demo.sh

demo-stop:
	bash pgrx-tests/demo.sh stop

test:
	bash pgrx-tests/test.sh

bootstrap:
	bash pgrx-tests/bootstrap.sh
