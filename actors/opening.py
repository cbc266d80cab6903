"""``kvactor.open()``: a session on a model, in this process or over a cluster: the one
entry that chooses between the two (the top of ``kvactor.actors``' layers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

from .cluster import CLUSTER_KEYS, ClusterOptions, ClusterSession, open_cluster
from .engine import ModelSpec
from .session import MODELS_KEYS, Opening, OpenOptions, Session, open_session

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ("open",)


@overload
def open(
    model: ModelSpec = None, *, cluster: None = None, **options: Unpack[OpenOptions]
) -> Opening[Session]: ...


@overload
def open(
    model: ModelSpec = None, *, cluster: str, **options: Unpack[ClusterOptions]
) -> Opening[ClusterSession]: ...


def open(
    model: ModelSpec = None, *, cluster: str | None = None, **options: Any
) -> Opening[Session] | Opening[ClusterSession]:
    """Open a session on ``model``: None for the default model (fetched once, verified), a
    ``.gguf`` file, a local MLX / Hugging Face model directory, or a callable returning a
    LoadedModel. ``max_batch`` (8) agents decode together; prompts are prefilled
    ``prefill_chunk`` (256) tokens at a time between decode steps.

    ``cache_dir`` turns on the warm tier there (``kvactor.default_cache_dir()`` is the
    usual place): every turn's new tokens are written to disk, demoted agents reload from
    there, and agents of a new session resume from it. The session holds the directory's
    lock: ``open`` raises CacheDirLocked when another session (of any process) has it.
    ``disk_limit``: the bytes the warm tier may hold on disk (default: the smaller of 30
    GiB and a quarter of the file system's free space; ``None``: no limit); past it agents
    go cold (their conversation kept, their next turn prefilled) in the policy's order,
    and a directory over a lower limit is brought under it at open. ``disk_quota``: the
    most the agents of one namespace (ids ``<namespace>.<name>``: a server's tenants) may
    hold on disk; a namespace over it makes its own agents cold, never another's.
    ``warm_ttl_s``: an agent whose warm cache was last written longer ago goes cold.
    ``write_budget``: the bytes the warm tier may write per ``write_window_s`` (a day):
    write-back instead of write-through. A turn's end commits only the conversation; a
    cache is written when it leaves the hot tier, is hinted done, or its agent stops, if
    the budget has room, else it goes cold. A crash loses the caches of the turns since
    their agent's last write (their text is kept: they are prefilled again).
    A turn whose write fails says so in its Completion (``saved``, ``save_error``); with
    ``on_save_error="raise"`` it raises StoreWriteError instead, holding the Completion.
    ``budget_bytes`` bounds the hot tier; ``codec`` picks how caches are stored (default
    ``DEFAULT_CODEC``: keys 5-bit, values 3-bit in groups of 64, Hadamard-rotated, 4 sink
    tokens at 8 bits); ``policy`` picks whom to demote (default ``WorkflowPolicy``: by
    the hints of ``Session.hint``, LRU order without them; a name, ``"lru"`` or
    ``"workflow"``, picks one of those). ``delete_rejected`` deletes
    warm caches that are refused (another model, corrupt) instead of setting them
    aside. ``mailbox_size`` (64) bounds each actor's mailbox.
    ``attention``: ``"quantized"`` runs attention and batches over the stored quantized
    caches, ``"dequantized"`` over a float copy made at each turn's start; ``"auto"``
    (default) picks quantized on a GPU and dequantized on the CPU (see EngineConfig).
    ``ready_copies`` (dequantized attention): hot agents keep their float copy between
    turns while the budget has room, so their next turn starts at once (dropped first when
    room is needed; answers are the same either way). ``share_prefixes``: a turn that
    reuses nothing of its own cache reuses the stored ranges of another hot cache its
    prompt begins with (a shared context: ``Session.context``), shared, not prefilled
    (the sharing agent attends over the stored values, as a warm resume does: see
    EngineConfig). ``tool_wait_s`` (30): how long a turn that ended in tool calls keeps
    its agent's cache hot ahead of idle agents, for the turn that brings the results.
    ``deterministic`` (False): a row's greedy answer never depends on what else runs in
    its batch (batch-invariant decode, ~10% slower on a CPU; see EngineConfig).
    ``checkpoints`` (recurrent layers: Qwen3.5, Mamba-2 ...): how many stored ranges of an
    agent keep the recurrent states at their end (default 4: the last two turns' prompts
    and answers), where a diverging turn can resume.
    ``models``: several models in one session, by name (``{"router": path_a, "coder": path_b}``;
    give no ``model`` then): one engine holds them all, each agent runs one (``spawn_agent(name,
    model="coder")``), each model's agents batch together, and each model's warm tier is
    ``cache_dir/models/<name>``. ``memory_limit``: the bytes the session may hold for its
    models, all counted: weights, activations, hot tiers, MLX's kept buffers (default:
    ``MEMORY_SHARE``, 3/4, of the machine's RAM, with one model or several; ``None`` with one
    model: no limit over the whole, only ``budget_bytes`` over its hot tier). A turn that needs
    room demotes idle caches to warm, then unloads an idle model (least recently used; never one
    of ``pin_models``; ``model_ttl_s``: unload one idle that long anyway); a model that cannot
    fit with one turn of its own fails ``open`` with ModelLoadError saying what it needs.
    ``cluster``: the session's engines run as Ray actors over a cluster ("auto", "local",
    an address or ``ray://host:port``), one engine host per node; the keywords then go to
    ``kvactor.actors.cluster.open_cluster`` (``cache_dir`` required; ``hosts_per_node``,
    ``placement``, ``ray_options``, ``replicas``) and every host's own session
    (``memory_limit`` is then each host's; default: its share of its node's). Without it
    Ray is never imported.

    Raises TypeError for an unknown keyword, ValueError for a bad value (an
    ``on_save_error`` other than "report" or "raise", a budget below 1 ...)."""
    known = ClusterOptions.__annotations__ if cluster is not None else OpenOptions.__annotations__
    unknown = sorted(set(options) - set(known))
    if unknown:
        hint = " (cluster options need cluster=...)" if set(unknown) & set(CLUSTER_KEYS) else ""
        raise TypeError(f"open() got unexpected keywords {unknown}{hint}")
    if cluster is not None:
        if set(options) & (set(MODELS_KEYS) - {"memory_limit"}):
            raise TypeError(
                "a cluster session serves one model: no models=, pin_models= or model_ttl_s="
            )
        if options.get("cache_dir") is None:
            raise ValueError("a cluster keeps each host's warm tier under cache_dir: give one")
        return open_cluster(model, cluster=cluster, **options)
    return open_session(model, **options)
