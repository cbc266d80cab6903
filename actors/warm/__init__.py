"""The warm tier: each agent's folder on local disk (manifest, segment files, checksums),
reading and verifying it, writing, linking forks and shared prefixes, forgetting and the
collector; the store and prefetch actors, the lock on a cache directory, and the warm
tier as an agent sees it."""

from __future__ import annotations

from ._dirlock import CacheDirLock as CacheDirLock
from ._dirlock import lock_cache_dir as lock_cache_dir
from ._durable import link_or_copy as link_or_copy
from ._durable import write_atomic as write_atomic
from ._forget import Forgotten as Forgotten
from ._forget import SharedFile as SharedFile
from ._forget import collect as collect
from ._forget import demote_cold as demote_cold
from ._forget import forget as forget
from ._forget import forget_cache as forget_cache
from ._link import fork_cache as fork_cache
from ._manifest import MANIFEST as MANIFEST
from ._manifest import SEGMENT_FILES as SEGMENT_FILES
from ._manifest import CacheIdentity as CacheIdentity
from ._manifest import CacheManifest as CacheManifest
from ._manifest import ExpectFn as ExpectFn
from ._manifest import SegmentEntry as SegmentEntry
from ._manifest import WarmInfo as WarmInfo
from ._manifest import read_manifest as read_manifest
from ._paths import agent_dir as agent_dir
from ._paths import contained as contained
from ._paths import default_cache_dir as default_cache_dir
from ._portable import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from ._portable import MAX_IMPORT_BYTES as MAX_IMPORT_BYTES
from ._portable import PortableHeader as PortableHeader
from ._portable import PortableInfo as PortableInfo
from ._portable import PortableReader as PortableReader
from ._portable import mark_ready as mark_ready
from ._portable import portable_chunks as portable_chunks
from ._portable import read_header as read_header
from ._portable import rename_staged as rename_staged
from ._portable import settle_imports as settle_imports
from ._portable import staging_dir as staging_dir
from ._prefetch import Prefetch as Prefetch
from ._prefetch import PrefetchActor as PrefetchActor
from ._prefetch import PrefetchMessage as PrefetchMessage
from ._protocol import Adopt as Adopt
from ._protocol import AgentNames as AgentNames
from ._protocol import FitDisk as FitDisk
from ._protocol import Forget as Forget
from ._protocol import ForkCache as ForkCache
from ._protocol import ListAgents as ListAgents
from ._protocol import StoreMessage as StoreMessage
from ._protocol import StoreStats as StoreStats
from ._protocol import StoreStatsQuery as StoreStatsQuery
from ._protocol import Sweep as Sweep
from ._protocol import WarmMoves as WarmMoves
from ._read import agent_names as agent_names
from ._read import disk_footprint as disk_footprint
from ._read import list_agents as list_agents
from ._read import read_cache as read_cache
from ._read import verify_cache as verify_cache
from ._read import verify_file as verify_file
from ._store import StoreActor as StoreActor
from ._tier import ActorWarmTier as ActorWarmTier
from ._tier import WarmTier as WarmTier
from ._usage import DISK_CEILING as DISK_CEILING
from ._usage import DISK_FILE as DISK_FILE
from ._usage import DISK_SHARE as DISK_SHARE
from ._usage import DiskUsage as DiskUsage
from ._usage import agent_files as agent_files
from ._usage import default_disk_limit as default_disk_limit
from ._usage import make_reserve as make_reserve
from ._usage import read_disk_limit as read_disk_limit
from ._usage import read_written as read_written
from ._usage import record_disk_limit as record_disk_limit
from ._usage import scan_agents as scan_agents
from ._usage import written_on_record_today as written_on_record_today

__all__ = (
    "Adopt",
    "MAX_HEADER_BYTES",
    "MAX_IMPORT_BYTES",
    "PortableHeader",
    "PortableInfo",
    "PortableReader",
    "mark_ready",
    "portable_chunks",
    "read_header",
    "rename_staged",
    "settle_imports",
    "staging_dir",
    "DISK_FILE",
    "record_disk_limit",
    "read_disk_limit",
    "read_written",
    "written_on_record_today",
    "make_reserve",
    "demote_cold",
    "FitDisk",
    "DISK_SHARE",
    "DISK_CEILING",
    "default_disk_limit",
    "scan_agents",
    "agent_files",
    "DiskUsage",
    "ActorWarmTier",
    "CacheDirLock",
    "CacheIdentity",
    "CacheManifest",
    "ExpectFn",
    "Forget",
    "Forgotten",
    "ForkCache",
    "AgentNames",
    "ListAgents",
    "MANIFEST",
    "Prefetch",
    "PrefetchActor",
    "PrefetchMessage",
    "SEGMENT_FILES",
    "SegmentEntry",
    "SharedFile",
    "StoreActor",
    "StoreMessage",
    "StoreStats",
    "StoreStatsQuery",
    "Sweep",
    "WarmInfo",
    "WarmTier",
    "agent_dir",
    "collect",
    "contained",
    "default_cache_dir",
    "disk_footprint",
    "forget",
    "forget_cache",
    "fork_cache",
    "link_or_copy",
    "write_atomic",
    "agent_names",
    "list_agents",
    "lock_cache_dir",
    "read_cache",
    "read_manifest",
    "verify_cache",
    "verify_file",
    "WarmMoves",
)
