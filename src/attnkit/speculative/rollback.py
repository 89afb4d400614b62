"""Rolling a session back after a speculative round: drop the newest slots, or restore a snapshot.

After a round a cache has been fed tokens beyond the ones the target accepted; those must be undone.
For a cache that only appends while decoding (``full``, the target's; ``snapkv``, which compresses the
prompt once) dropping the newest slots (``LayerKV.length -= k``) is exact: later slots are never read
and the next append overwrites them (:func:`drop_newest`). An evicting cache cannot be truncated:
writing a drafted token may have evicted an entry for good, and the method's statistics
(``LayerKV.extras`` score buffers, ``session.layer_state`` counters and saved keys, ``session.state``
scores) have absorbed the drafted tokens. For those the draft snapshots the whole session after each
token it feeds (:func:`snapshot_session`: tensors cloned, one copy of the *compressed* cache per
drafted token) and restores the snapshot of the last accepted token (:func:`restore_session`, no
replay forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.errors import AttnkitError
from attnkit.session import Session, copy_state


@dataclass
class SessionSnapshot:
    layers: list
    layer_state: list
    state: object


def snapshot_session(session: Session) -> SessionSnapshot:
    """Everything a method may change while decoding: every layer's slots (keys, values, positions,
    length, extras) and the per-layer and shared method state."""
    layers = [None if kv is None else kv.clone() for kv in session.cache.layers]
    return SessionSnapshot(layers, copy_state(session.layer_state), copy_state(session.state))


def restore_session(session: Session, snap: SessionSnapshot) -> None:
    """Put a snapshot back (its tensors are handed over, not copied again: use each snapshot once)."""
    session.cache.layers = list(snap.layers)
    session.layer_state = snap.layer_state
    session.state = snap.state


def drop_newest(session: Session, count: int) -> None:
    """Undo the last `count` tokens fed to a cache that only appends while decoding (``full``, the
    target's; ``Method.decode_only_appends``, a compressed draft cache, which holds fewer slots than
    positions): its newest `count` slots in every layer are never read again and are overwritten by the
    next append."""
    for kv in session.cache.layers:
        if kv is None:
            continue
        if kv.ring:
            raise AttnkitError("a ring-buffer cache has overwritten the entries a rollback would restore; "
                               "snapshot the session instead")
        if not 0 <= count <= kv.length:
            raise AttnkitError(f"cannot drop the newest {count} of {kv.length} entries of this cache")
        kv.length -= count
