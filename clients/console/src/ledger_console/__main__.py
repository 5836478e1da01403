"""The console's command line.

    python -m ledger_console serve [--port 8765] [--session-hours 12]   # env LEDGER_CONSOLE_DSN, LEDGER_CONSOLE_SCOPES
    python -m ledger_console users add NAME [--password-stdin]
    python -m ledger_console users remove NAME
    python -m ledger_console users list

The console listens on the loopback interface only and prints its URL once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
from pathlib import Path

import uvicorn

from .app import create_app
from .console import ConsoleConfig
from .data import NotAllowed
from .users import Users

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_scopes(text: str) -> list[tuple[str, str]]:
    """`tenant/workspace[,tenant/workspace...]`."""
    scopes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, workspace = item.partition("/")
        if not sep or not tenant or not workspace:
            raise ValueError(f"a scope is tenant/workspace, not {item!r}")
        scopes.append((tenant, workspace))
    if not scopes:
        raise ValueError("no scope given (LEDGER_CONSOLE_SCOPES=tenant/workspace,...)")
    return scopes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ledger_console", description="The ledger's operator console.")
    parser.add_argument("--users-file", type=Path,
                        default=Path(os.environ.get("LEDGER_CONSOLE_USERS", "console-users.json")),
                        help="the people who may sign in (env LEDGER_CONSOLE_USERS)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the console on the loopback interface")
    serve.add_argument("--dsn", default=os.environ.get("LEDGER_CONSOLE_DSN"),
                       help="connection string of a login role granted ledger_writer or ledger_reader (env LEDGER_CONSOLE_DSN)")
    serve.add_argument("--scopes", default=os.environ.get("LEDGER_CONSOLE_SCOPES", ""),
                       help="tenant/workspace,... that people may pick (env LEDGER_CONSOLE_SCOPES)")
    serve.add_argument("--host", default="127.0.0.1", choices=LOOPBACK)
    serve.add_argument("--port", type=int, default=int(os.environ.get("LEDGER_CONSOLE_PORT", "8765")))
    serve.add_argument("--session-hours", type=float,
                       default=float(os.environ.get("LEDGER_CONSOLE_SESSION_HOURS", "12")),
                       help="how long a sign-in lasts at most, in hours (env LEDGER_CONSOLE_SESSION_HOURS, default 12)")
    users = sub.add_parser("users", help="manage the people who may sign in")
    users_sub = users.add_subparsers(dest="action", required=True)
    add = users_sub.add_parser("add", help="add a person, or change their password")
    add.add_argument("name")
    add.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    users_sub.add_parser("remove").add_argument("name")
    users_sub.add_parser("list")
    args = parser.parse_args(argv)

    people = Users(args.users_file)
    if args.command == "users":
        if args.action == "add":
            password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("password: ")
            try:
                people.set(args.name, password)
            except ValueError as exc:
                print(f"ledger console: {exc}", file=sys.stderr)
                return 2
            print(f"ledger console: {args.name} may sign in ({args.users_file})")
        elif args.action == "remove":
            if not people.remove(args.name):
                print(f"ledger console: no person {args.name}", file=sys.stderr)
                return 1
        else:
            print("\n".join(people.names()))
        return 0

    if not args.dsn:
        print("ledger console: no database: set LEDGER_CONSOLE_DSN or pass --dsn", file=sys.stderr)
        return 2
    try:
        scopes = parse_scopes(args.scopes)
        if not 0.02 <= args.session_hours <= 720:
            raise ValueError("--session-hours takes 0.02 to 720 (about a minute to 30 days)")
        secret = os.environ.get("LEDGER_CONSOLE_SECRET")
        config = ConsoleConfig(dsn=args.dsn, users=args.users_file, scopes=scopes,
                               session_max_age_s=round(args.session_hours * 3600),
                               **({"secret": bytes.fromhex(secret)} if secret else {}))
        app = create_app(config)
    except (ValueError, NotAllowed) as exc:
        print(f"ledger console: {exc}", file=sys.stderr)
        return 2
    if not people.names():
        print(f"ledger console: nobody may sign in yet; add a person with"
              f" `python -m ledger_console --users-file {args.users_file} users add NAME`", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=2))  # open live streams end then
    host = f"[{args.host}]" if ":" in args.host else args.host

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"ledger console: http://{host}:{args.port}/ (Ctrl-C stops it)", flush=True)
        await task

    asyncio.run(run())
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
