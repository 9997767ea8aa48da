"""Search attributes and memo that make every llmgw workflow findable in the Temporal UI.

- `LlmgwModel` (Keyword): the catalog model a lifecycle is about;
- `LlmgwNode` (KeywordList): every node it touches (a multi-node replica has shards on several; a
  KeywordList matches `LlmgwNode = "gpu-b"` when any of them is gpu-b);
- `LlmgwReplica` (Keyword): the replica id;
- `LlmgwKind` (Keyword): `reconciler`, `start`, `stop`, `reclaim`, `logs`, `rollout`, `batch`.

So `LlmgwModel = "smollm2-135m"` lists a model's whole history, `LlmgwReplica = "<id>"` one replica's start
and stop. A namespace must register them first (`llmgw dev` and the test fixtures do;
`temporal operator search-attribute create` in production, docs/operating.md). Where they are not
registered, workflows start without them (a start that names an unregistered attribute is refused by the
server, and a child start refused that way would stall the reconciler), so whoever starts a workflow asks
`enabled` first: the control worker checks the namespace and passes the answer to the reconciler in its
snapshot. The memo (`model`, `profile`) needs no registration and is always set.

Pure and deterministic: imported by workflow code.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

MODEL = SearchAttributeKey.for_keyword("LlmgwModel")
NODE = SearchAttributeKey.for_keyword_list("LlmgwNode")
REPLICA = SearchAttributeKey.for_keyword("LlmgwReplica")
KIND = SearchAttributeKey.for_keyword("LlmgwKind")

# name -> type as `temporal operator search-attribute create --type` and `start-dev --search-attribute` spell it
REGISTRY: dict[str, str] = {"LlmgwModel": "Keyword", "LlmgwNode": "KeywordList", "LlmgwReplica": "Keyword",
                            "LlmgwKind": "Keyword"}


def lifecycle(kind: str, model: str | None = None, replica_id: str | None = None,
              nodes: list[str] | None = None) -> TypedSearchAttributes:
    """The search attributes of one workflow: its kind, and the model, replica and nodes it is about."""
    pairs: list[SearchAttributePair] = [SearchAttributePair(KIND, kind)]
    if model:
        pairs.append(SearchAttributePair(MODEL, model))
    if replica_id:
        pairs.append(SearchAttributePair(REPLICA, replica_id))
    if nodes:
        pairs.append(SearchAttributePair(NODE, sorted(set(nodes))))
    return TypedSearchAttributes(pairs)


def memo(model: str, profile: str | None = None) -> dict[str, str]:
    """What the Temporal UI shows beside a replica's workflow: its model and profile."""
    return {"model": model, **({"profile": profile} if profile else {})}
