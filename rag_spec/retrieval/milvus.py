"""A knowledge base in Milvus: milvus-lite in a local folder, or a Milvus server or cluster.

The same code serves both: ``uri`` is a local folder (served by rag-spec's own milvus-lite
process, see ``milvus_lite``) or ``http(s)://host:port`` with an optional ``token``.

Layout in Milvus: a collection per build, ``<alias>_<fingerprint>_<time>``, with fields ``id``
(INT64 primary key, a hash of the passage), ``vector`` (unit embeddings, inner product),
``title`` and ``text``; its properties record the corpus fingerprint and the embedder. Clients
search the alias (``rag_spec_<corpus>``). A build fills a new collection, then switches the
alias and drops the old one, so an interrupted build leaves the previous one serving and a
half-built collection is never searched.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rag_spec.corpus import DEFAULT_SOURCES, Passage, fingerprint, load_passages
from rag_spec.errors import RagSpecError
from rag_spec.paths import cache_dir
from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.knowledge_base import corpus_dir, passage_vectors
from rag_spec.retrieval.types import Hit, check_search_args, stable_id

INDEXES = {  # Milvus index type and build parameters, per rag-spec index kind
    "hnsw": ("HNSW", {"M": 32, "efConstruction": 80}),
    "flat": ("FLAT", {}),
}
HNSW_EF = 64
INSERT_BATCH = 256
TITLE_MAX, TEXT_MAX = 1024, 65535
FIELDS = ["title", "text", "vector"]


def default_uri() -> str:
    """The local milvus-lite folder under the rag-spec cache."""
    return str(cache_dir() / "milvus" / "rag_spec.db")


class MilvusKnowledgeBase:
    """Passages in a Milvus collection, searched in batches: ``search(queries, k)``.

    Hits carry the passage's vector, so SpecRetriever scores its guesses locally (it needs no
    ``score`` call per guess). Every request has a deadline of ``timeout`` seconds.

    Examples:
        >>> kb = MilvusKnowledgeBase.open()                     # doctest: +SKIP
        >>> kb.search(["join two paths"], k=1)[0][0].title       # doctest: +SKIP
        'posixpath.join'
    """

    kind = "milvus"

    def __init__(self, client: Any, uri: str, alias: str, embedder: Embedder, *,
                 passages: int, timeout: float, token: str | None = None) -> None:
        self.client = client
        self.uri = uri
        self.token = token
        self.alias = alias
        self.embedder = embedder
        self.passages = passages
        self.timeout = timeout
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.passages

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        """Top-``k`` passages for each query, best first, in one request."""
        check_search_args(queries, k)
        if not queries:
            return []
        vectors = self.embedder.encode_queries(list(queries))
        with _translated(self.uri, "search", self.timeout):
            found = self._search(vectors, k)
        return [[Hit(doc_id=int(h["id"]), score=float(h["distance"]),
                     title=h["entity"]["title"], text=h["entity"]["text"],
                     vector=np.asarray(h["entity"]["vector"], dtype=np.float32))
                 for h in hits] for hits in found]

    def _search(self, vectors: np.ndarray, k: int) -> Any:
        """One search request, tried again once after a recoverable failure: a collection
        that a restarted server holds released (load it), or a lost connection (connect
        afresh; a local milvus-lite process that died is started again)."""
        from pymilvus import MilvusException

        client = self.client
        try:
            return self._request(client, vectors, k)
        except MilvusException as err:
            if self.client is client:  # else another thread already connected afresh
                if "load()" in str(err):
                    client.load_collection(self.alias, timeout=self.timeout)
                elif _unavailable(str(err)):
                    self._reconnect(client)
                else:
                    raise
        return self._request(self.client, vectors, k)

    def _request(self, client: Any, vectors: np.ndarray, k: int) -> Any:
        return client.search(
            self.alias, data=list(vectors), limit=k, output_fields=FIELDS,
            search_params={"metric_type": "IP", "params": {"ef": max(HNSW_EF, k)}},
            timeout=self.timeout)

    def _reconnect(self, broken: Any) -> None:
        """A fresh client in place of ``broken`` (once, however many threads saw it fail)."""
        with self._lock:
            if self.client is broken:  # the new client first: if the server is still down,
                fresh = connect(self.uri, self.token, self.timeout)  # the old one stays open
                fresh.load_collection(self.alias, timeout=self.timeout)
                self.client = fresh
                broken.close()

    # -- building and opening ------------------------------------------------------------------

    @classmethod
    def open(cls, sources: Sequence[str] = DEFAULT_SOURCES, *, uri: str | None = None,
             token: str | None = None, collection: str | None = None,
             index: str | None = None,
             rebuild: bool = False, progress: bool = True,
             timeout: float = 10.0) -> MilvusKnowledgeBase:
        """The collection for ``sources`` at ``uri``, built (and aliased) if it is missing.

        Args:
            sources: the corpus, as ``KnowledgeBase.open`` takes it.
            uri: a local folder for milvus-lite (default: under the rag-spec cache) or
                ``http(s)://host:port`` of a Milvus server or cluster.
            token: the server's token ("user:password" or an API key), if it asks for one.
            collection: the alias clients search (default ``rag_spec_<corpus>``).
            index: "hnsw" (approximate) or "flat" (exact); None: the serving collection's,
                "hnsw" for a new one. A serving collection with another index is refused.
            rebuild: build a new collection even if one is serving.
            timeout: seconds before any request gives up.
        """
        _require_pymilvus()
        if index not in (None, *INDEXES):
            msg = f"Unknown Milvus index {index!r}; use one of {', '.join(INDEXES)}."
            raise RagSpecError(msg)
        uri = uri or default_uri()
        alias = collection or "rag_spec_" + re.sub(r"\W", "_", corpus_dir(sources).name)
        passages = load_passages(sources)
        embedder = Embedder.default()
        client = connect(uri, token, timeout)
        if rebuild and not is_server(uri):  # a damaged collection is replaced, not read
            client = _set_aside_damaged(client, uri, alias, token, timeout)
        with _translated(uri, "open", timeout):
            serving = client.has_collection(alias, timeout=timeout)
            if rebuild or not serving:
                if progress:
                    print(f"rag-spec: building the Milvus collection {alias} over "
                          f"{len(passages)} passages at {uri} (once).")
                vectors = passage_vectors(sources, passages, embedder, progress)
                build(client, alias, passages, vectors, embedder.name, index=index or "hnsw",
                      timeout=timeout, progress=progress)
            else:
                _check(client, alias, fingerprint(passages), embedder, index, timeout)
                client.load_collection(alias, timeout=timeout)
            count = int(client.get_collection_stats(alias, timeout=timeout)["row_count"])
        expected = len({_key(p) for p in passages})  # equal passages share a row
        if count != expected:
            msg = (f"The Milvus collection {alias} at {uri} holds {count} passages, but the "
                   f"corpus has {expected}: it is damaged or was cut short, and would retrieve "
                   f"wrong or no passages. Rebuild it with `rag-spec index build --backend "
                   f"milvus --rebuild` and the same --source and --uri "
                   f"(MilvusKnowledgeBase.open(..., rebuild=True)).")
            raise RagSpecError(msg)
        return cls(client, uri, alias, embedder, passages=count, timeout=timeout, token=token)


_DAMAGED = re.compile(r"manifest\.json and manifest\.json\.prev failed to load in '([^']+)'")


def _set_aside_damaged(client: Any, uri: str, alias: str, token: str | None,
                       timeout: float) -> Any:
    """A milvus-lite folder any of whose collections' files cannot be read serves nothing (it
    cannot even list its collections), whichever corpus the damaged one holds: move each
    such collection's folder aside (``damaged-<name>`` in the folder), restarting the server
    after each, until the folder serves again. Another corpus's collection set aside is built
    again the next time that corpus is opened."""
    from pymilvus import MilvusException

    from rag_spec.retrieval.milvus_lite import LiteServer

    aside: set[Path] = set()
    while True:
        try:  # every collection read, not only the alias's: one damaged stops them all
            for name in client.list_collections(timeout=timeout):
                client.describe_collection(name, timeout=timeout)
        except MilvusException as err:
            damaged = _DAMAGED.search(getattr(err, "message", None) or str(err))
        else:
            return client
        if damaged is None or Path(damaged.group(1)) in aside:  # another failure: ``open``
            return client                                        # reports it
        folder = Path(damaged.group(1))
        LiteServer.serving(uri).stop()
        os.replace(folder, Path(uri).expanduser() / f"damaged-{folder.name}-{time.time_ns()}")
        aside.add(folder)
        whose = "rebuilding it" if folder.name.startswith(f"{alias}_") else \
            "another corpus's: it is built again when that corpus is next opened"
        print(f"rag-spec: the Milvus collection {folder.name} could not be read; set aside as "
              f"damaged-{folder.name}-... in {uri} ({whose}).", file=sys.stderr)
        client = connect(uri, token, timeout)


def connect(uri: str, token: str | None, timeout: float) -> Any:
    """A MilvusClient for ``uri``: a server URL as is, a local folder through milvus-lite."""
    from pymilvus import MilvusClient

    address = uri
    if not is_server(uri):
        from rag_spec.retrieval.milvus_lite import LiteServer

        if Path(uri).expanduser().exists() and not Path(uri).expanduser().is_dir():
            msg = (f"{uri} is a file, not a milvus-lite folder: give --uri a folder (created if "
                   f"missing; default {default_uri()}) or a server's http(s)://host:port.")
            raise RagSpecError(msg)

        address = LiteServer.serving(uri).uri
    with _translated(uri, "connect to", timeout):
        # Its own connection and subchannel: a fresh client after a failure connects at once,
        # where a shared one would wait out the failed connection's back-off.
        return MilvusClient(uri=address, token=token or "", timeout=timeout, dedicated=True,
                            grpc_options={"grpc.use_local_subchannel_pool": 1})


def build(client: Any, alias: str, passages: Sequence[Passage], vectors: np.ndarray,
          embedder_name: str, *, index: str = "hnsw", timeout: float = 10.0,
          progress: bool = False) -> str:
    """Fill a new collection with ``passages`` and their unit ``vectors``, then point ``alias``
    at it; returns its name.

    Collections of earlier builds that never got the alias (interrupted) are dropped first;
    the collection the alias leaves is dropped last.
    """
    from pymilvus import DataType
    from tqdm.auto import tqdm

    corpus = fingerprint(passages)
    previous = _aliased(client, alias, timeout)
    for name in client.list_collections(timeout=timeout):
        if name.startswith(f"{alias}_") and name != previous:
            client.drop_collection(name, timeout=timeout)
    name = f"{alias}_{corpus[:12]}_{time.time_ns()}"
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=vectors.shape[1])
    schema.add_field("title", DataType.VARCHAR, max_length=TITLE_MAX)
    schema.add_field("text", DataType.VARCHAR, max_length=TEXT_MAX)
    index_type, params = INDEXES[index]
    index_params = client.prepare_index_params()
    index_params.add_index("vector", index_type=index_type, metric_type="IP", params=params)
    client.create_collection(name, schema=schema, index_params=index_params, timeout=timeout,
                             properties={"rag_spec.fingerprint": corpus,
                                         "rag_spec.embedder": embedder_name,
                                         "rag_spec.index": index})
    rows = list({_key(p): (p, v) for p, v in zip(passages, vectors)}.items())  # equal: one row
    with tqdm(total=len(rows), desc="milvus insert", unit="passage",
              disable=not progress) as bar:
        for start in range(0, len(rows), INSERT_BATCH):
            batch = rows[start:start + INSERT_BATCH]
            client.insert(name, [
                {"id": key, "vector": vector, "title": p.title[:TITLE_MAX],
                 "text": p.text[:TEXT_MAX]} for key, (p, vector) in batch], timeout=timeout)
            bar.update(len(batch))
    client.flush(name, timeout=timeout)
    client.load_collection(name, timeout=timeout)
    if previous is None:
        client.create_alias(name, alias, timeout=timeout)
    else:
        client.alter_alias(name, alias, timeout=timeout)
        client.drop_collection(previous, timeout=timeout)
    return name


def _key(passage: Passage) -> int:
    return stable_id(f"{passage.title}\n{passage.text}")


def _aliased(client: Any, alias: str, timeout: float) -> str | None:
    """The collection ``alias`` points at (None: no such alias)."""
    if alias not in client.list_aliases(timeout=timeout).get("aliases", []):
        return None
    return str(client.describe_alias(alias, timeout=timeout)["collection_name"])


def _check(client: Any, alias: str, corpus: str, embedder: Embedder, index: str | None,
           timeout: float) -> None:
    """Refuse a collection built from other passages, with another embedder or index."""
    properties = client.describe_collection(alias, timeout=timeout).get("properties", {})
    if index is not None and properties.get("rag_spec.index") != index:
        msg = (f"The Milvus collection {alias} has a {properties.get('rag_spec.index')} index, "
               f"not {index}; rebuild it with `rag-spec index build --backend milvus --kind "
               f"{index} --rebuild` (MilvusKnowledgeBase.open(..., rebuild=True)), or open it "
               f"with index=None.")
        raise RagSpecError(msg)
    built = (properties.get("rag_spec.fingerprint"), properties.get("rag_spec.embedder"))
    if built != (corpus, embedder.name):
        msg = (f"The Milvus collection {alias} was built from other passages or with another "
               f"embedder (collection: {built[0]}/{built[1]}, now: {corpus}/{embedder.name}), "
               f"so guesses and answers would not match this corpus; rebuild it with "
               f"`rag-spec index build --backend milvus --rebuild` "
               f"(MilvusKnowledgeBase.open(..., rebuild=True)).")
        raise RagSpecError(msg)


@contextmanager
def _translated(uri: str, action: str, timeout: float) -> Iterator[None]:
    """Milvus and gRPC failures as one RagSpecError that names the fix."""
    import grpc
    from pymilvus import MilvusException

    try:
        yield
    except (MilvusException, grpc.RpcError) as err:
        reason = (f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError)
                  else getattr(err, "message", None) or str(err))
        if _DAMAGED.search(reason):
            hint = (f"its files are damaged. Rebuild it with `rag-spec index build --backend "
                    f"milvus --rebuild` and the same --source and --uri {uri} "
                    f"(MilvusKnowledgeBase.open(..., rebuild=True)), which sets the damaged "
                    f"collection aside" if not is_server(uri) else
                    "its files are damaged: see the server's log")
        elif _unavailable(reason):
            hint = (f"is the server running at {uri}? rag-spec starts milvus-lite itself for a "
                    f"local folder; a server URI must be reachable from here")
        elif "deadline" in reason.lower() or "timeout" in reason.lower():
            hint = (f"the server did not answer within {timeout:g} s; raise "
                    f"MilvusKnowledgeBase.open(timeout=...) if it is busy")
        else:
            hint = "see the server's log"
        msg = f"Milvus could not {action} ({reason.strip()}): {hint}."
        raise RagSpecError(msg) from err


def _unavailable(reason: str) -> bool:
    return any(s in reason.lower() for s in ("unavailable", "fail connecting", "refused"))


def _require_pymilvus() -> None:
    try:
        import milvus_lite  # noqa: F401
        import pymilvus  # noqa: F401
    except ImportError as err:
        msg = (f"The Milvus knowledge base needs pymilvus and milvus-lite ({err}); install them "
               f"with: pip install 'rag-spec[milvus]'.")
        raise RagSpecError(msg) from err


def is_server(uri: str) -> bool:
    """Whether ``uri`` names a server (else it is a local milvus-lite folder)."""
    return bool(re.match(r"^(https?|tcp|grpc)://", uri))
