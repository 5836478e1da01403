"""The ledger as LangGraph's checkpointer: :class:`LedgerSaver`, a ``BaseCheckpointSaver`` (sync
and async) over the ledger's graph-checkpoint functions (manual: clients/python/docs/langgraph.md,
"Checkpointer").

Checkpoints, channel values and pending writes live in the ledger under row-level security, in
the handle's scope. Channel values and writes are the serializer's opaque bytes (``dumps_typed``:
type and bytes) and come back byte for byte; the metadata is redacted like every JSON the ledger
stores. Each checkpoint is tied to the ledger run of the invocation that wrote it: the run in
``config["configurable"]["ledger_run_id"]`` (what :func:`~ledger_client.integrations.langgraph.start_run`
returns, so the tool guard's calls and the checkpoints share one run), else a run the saver
creates once per LangGraph run id (``metadata["run_id"]``) or, without one, per thread. Every
write is idempotent (a checkpoint stored again replaces itself, a write stored again is kept), so
it is tried again across a lost connection, as the client's other idempotent writes are.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from psycopg.types.json import Jsonb

from .._faults import again, again_async
from ..aio import AsyncScopedLedger
from ..client import ScopedLedger
from ..statement import Row
from ..types import RunStatus
from .langgraph import RUN_ID_KEY

RUN_MODE = "langgraph"
"""The mode of the runs the saver creates itself (when the config names no ledger run)."""

_ID = re.compile(r"[!-~]{1,100}")

_TUPLES = ("SELECT * FROM ledger.graph_checkpoint_tuples(%s, %s, %s, filter => %s, before => %s,"
           " max_checkpoints => %s)")


def _request_id(kind: str, value: str) -> str:
    """The request id of the saver's own run: readable when the value is a plain id, else hashed
    (a thread id may be any text, a request id may not)."""
    text = value if _ID.fullmatch(value) else hashlib.sha256(value.encode()).hexdigest()[:40]
    return f"langgraph-{kind}:{text}"


def _configurable(config: RunnableConfig | None) -> Mapping[str, Any]:
    return (config or {}).get("configurable") or {}


class _Saver(BaseCheckpointSaver[str]):
    """LedgerSaver's encoding and decoding (the statements and their rows), apart from its I/O."""

    runs_kept = 1024
    """How many of its own runs' ids the saver remembers (the oldest is forgotten first: a service
    serves unboundedly many threads; a forgotten run is found again by its request id)."""

    def __init__(self, *, serde: SerializerProtocol | None = None) -> None:
        super().__init__(serde=serde)
        self._runs: dict[str, str] = {}

    def _remember(self, request: str, run_id: str) -> str:
        while len(self._runs) >= self.runs_kept:
            del self._runs[next(iter(self._runs))]
        self._runs[request] = run_id
        return run_id

    def get_next_version(self, current: str | None, channel: None = None) -> str:
        """Zero-padded counters (so that they sort as text) with a random tail: a thread resumed
        from an older checkpoint never reuses a stored (channel, version) for another value."""
        number = 0 if current is None else int(str(current).split(".")[0])
        return f"{number + 1:032}.{random.getrandbits(53):016}"

    @staticmethod
    def _run_request(config: RunnableConfig, metadata: Mapping[str, Any]) -> tuple[str | None, str]:
        """The configured ledger run, or the request id of the saver's own run."""
        configured = _configurable(config).get(RUN_ID_KEY) or metadata.get(RUN_ID_KEY)
        if configured:
            return str(configured), ""
        framework_run = metadata.get("run_id")
        if framework_run:
            return None, _request_id("run", str(framework_run))
        return None, _request_id("thread", str(_configurable(config)["thread_id"]))

    def _put_params(self, run_id: str, config: RunnableConfig, checkpoint: Checkpoint,
                    metadata: CheckpointMetadata, new_versions: ChannelVersions) -> tuple[str, list[Any]]:
        conf = _configurable(config)
        stored = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        values = checkpoint["channel_values"]
        channels, versions, types, blobs = [], [], [], []
        for channel, version in new_versions.items():
            kind, data = self.serde.dumps_typed(values[channel]) if channel in values else ("empty", None)
            channels.append(channel)
            versions.append(str(version))
            types.append(kind)
            blobs.append(data)
        return ("SELECT ledger.put_graph_checkpoint(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [run_id, conf["thread_id"], conf.get("checkpoint_ns", ""), checkpoint["id"], Jsonb(stored),
                 Jsonb(get_serializable_checkpoint_metadata(config, metadata)), conf.get("checkpoint_id"),
                 channels, versions, types, blobs])

    @staticmethod
    def _put_config(config: RunnableConfig, checkpoint: Checkpoint) -> RunnableConfig:
        conf = _configurable(config)
        return {"configurable": {"thread_id": conf["thread_id"], "checkpoint_ns": conf.get("checkpoint_ns", ""),
                                 "checkpoint_id": checkpoint["id"]}}

    def _writes_params(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                       task_path: str) -> tuple[str, list[Any]]:
        conf = _configurable(config)
        idxs, channels, types, blobs = [], [], [], []
        for i, (channel, value) in enumerate(writes):
            kind, data = self.serde.dumps_typed(value)
            idxs.append(WRITES_IDX_MAP.get(channel, i))
            channels.append(channel)
            types.append(kind)
            blobs.append(data)
        # Special channels (error, interrupt, ...) replace their earlier write; others keep the first.
        upsert = all(channel in WRITES_IDX_MAP for channel, _ in writes)
        return ("SELECT ledger.put_graph_checkpoint_writes(%s, %s, %s, %s, %s, %s, %s, %s, task_path => %s,"
                " upsert => %s)",
                [conf["thread_id"], conf.get("checkpoint_ns", ""), conf["checkpoint_id"], task_id, idxs, channels,
                 types, blobs, task_path, upsert])

    @staticmethod
    def _list_params(config: RunnableConfig | None, filter: dict[str, Any] | None,
                     before: RunnableConfig | None, limit: int | None) -> list[Any]:
        conf = _configurable(config)
        return [conf.get("thread_id"), conf.get("checkpoint_ns"), get_checkpoint_id(config) if config else None,
                Jsonb(filter) if filter else None, _configurable(before).get("checkpoint_id"), limit]

    @staticmethod
    def _get_params(config: RunnableConfig) -> list[Any]:
        conf = _configurable(config)
        return [conf["thread_id"], conf.get("checkpoint_ns", ""), get_checkpoint_id(config), None, None, 1]

    def _tuple(self, row: Row) -> CheckpointTuple:
        place = {"thread_id": row["thread_id"], "checkpoint_ns": row["checkpoint_ns"]}
        checkpoint: dict[str, Any] = dict(row["checkpoint"])
        checkpoint["channel_values"] = {
            channel: self.serde.loads_typed((kind, bytes(data)))
            for channel, kind, data in zip(row["channels"], row["blob_types"], row["blobs"], strict=True)
            if kind != "empty"
        }
        writes = [(task, channel, self.serde.loads_typed((kind, bytes(data) if data is not None else b"")))
                  for task, channel, kind, data in zip(row["write_task_ids"], row["write_channels"],
                                                       row["write_blob_types"], row["write_blobs"], strict=True)]
        parent = row["parent_checkpoint_id"]
        return CheckpointTuple(
            config={"configurable": {**place, "checkpoint_id": row["checkpoint_id"]}},
            checkpoint=checkpoint,  # type: ignore[arg-type]  # the TypedDict, as stored
            metadata=row["metadata"],
            parent_config={"configurable": {**place, "checkpoint_id": parent}} if parent else None,
            pending_writes=writes,
        )


class LedgerSaver(_Saver):
    """LangGraph's checkpointer in the ledger (see the module's docstring). ``ledger`` serves the
    sync methods (``graph.invoke``), ``aledger`` the async ones (``graph.ainvoke``): give the one
    your graph runs with, or both. ``serde``: LangGraph's serializer (default ``JsonPlusSerializer``;
    an ``EncryptedSerializer`` keeps the state secret at rest). Parameters: the manual."""

    def __init__(self, ledger: ScopedLedger | None = None, *, aledger: AsyncScopedLedger | None = None,
                 serde: SerializerProtocol | None = None) -> None:
        if ledger is None and aledger is None:
            raise TypeError("LedgerSaver needs a ledger (sync graphs) or an aledger (async graphs)")
        super().__init__(serde=serde)
        self.ledger = ledger
        self.aledger = aledger

    def _sync(self) -> ScopedLedger:
        if self.ledger is None:
            raise TypeError("LedgerSaver: this saver has no sync ledger (give ledger=...)")
        return self.ledger

    def _async(self) -> AsyncScopedLedger:
        if self.aledger is None:
            raise TypeError("LedgerSaver: this saver has no async ledger (give aledger=...)")
        return self.aledger

    # The run of an invocation

    def _run_id(self, config: RunnableConfig, metadata: Mapping[str, Any]) -> str:
        configured, request = self._run_request(config, metadata)
        if configured is not None:
            return configured
        if request not in self._runs:
            def create() -> str:
                with self._sync().transaction() as tx:
                    run = tx.create_run(RUN_MODE, request_id=request)
                    if run.status is RunStatus.QUEUED:  # running without a lease: no worker claims it
                        tx.transition_run(run.id, RunStatus.RUNNING)
                    return run.id
            return self._remember(request, again(f"run of {request}", create))
        return self._runs[request]

    async def _arun_id(self, config: RunnableConfig, metadata: Mapping[str, Any]) -> str:
        configured, request = self._run_request(config, metadata)
        if configured is not None:
            return configured
        if request not in self._runs:
            async def create() -> str:
                async with self._async().transaction() as tx:
                    run = await tx.create_run(RUN_MODE, request_id=request)
                    if run.status is RunStatus.QUEUED:
                        await tx.transition_run(run.id, RunStatus.RUNNING)
                    return run.id
            return self._remember(request, await again_async(f"run of {request}", create))
        return self._runs[request]

    # Sync

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        rows = self._sync().execute(_TUPLES, self._get_params(config))
        return self._tuple(rows[0]) if rows else None

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        for row in self._sync().execute(_TUPLES, self._list_params(config, filter, before, limit)):
            yield self._tuple(row)

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        query, params = self._put_params(self._run_id(config, metadata), config, checkpoint, metadata, new_versions)
        again(f"checkpoint {checkpoint['id']}", lambda: self._sync().execute(query, params))
        return self._put_config(config, checkpoint)

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        query, params = self._writes_params(config, writes, task_id, task_path)
        again(f"writes of task {task_id}", lambda: self._sync().execute(query, params))

    def delete_thread(self, thread_id: str) -> None:
        self._sync().execute("SELECT ledger.delete_graph_thread(%s)", [thread_id])

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._sync().execute("SELECT ledger.delete_graph_checkpoints_for_runs(%s)", [list(run_ids)])

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._sync().execute("SELECT ledger.copy_graph_thread(%s, %s)", [source_thread_id, target_thread_id])

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._sync().execute("SELECT ledger.prune_graph_threads(%s, %s)", [list(thread_ids), strategy])

    # Async

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        rows = await self._async().execute(_TUPLES, self._get_params(config))
        return self._tuple(rows[0]) if rows else None

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        for row in await self._async().execute(_TUPLES, self._list_params(config, filter, before, limit)):
            yield self._tuple(row)

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        query, params = self._put_params(await self._arun_id(config, metadata), config, checkpoint, metadata,
                                         new_versions)
        await again_async(f"checkpoint {checkpoint['id']}", lambda: self._async().execute(query, params))
        return self._put_config(config, checkpoint)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        query, params = self._writes_params(config, writes, task_id, task_path)
        await again_async(f"writes of task {task_id}", lambda: self._async().execute(query, params))

    async def adelete_thread(self, thread_id: str) -> None:
        await self._async().execute("SELECT ledger.delete_graph_thread(%s)", [thread_id])

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._async().execute("SELECT ledger.delete_graph_checkpoints_for_runs(%s)", [list(run_ids)])

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._async().execute("SELECT ledger.copy_graph_thread(%s, %s)", [source_thread_id, target_thread_id])

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._async().execute("SELECT ledger.prune_graph_threads(%s, %s)", [list(thread_ids), strategy])
