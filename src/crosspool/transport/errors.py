"""Why an FFN layer call failed, as types: what an engine rank (and a test) tells apart without
reading the message. Every message names the model, the layer and what failed."""

from __future__ import annotations


class FfnCallError(RuntimeError):
    """A layer call did not get its FFN result. The engine fails the request with this message."""


class FfnCallRejected(FfnCallError):
    """The call itself is wrong for its mailbox (shape, dtype, more rows than it holds), or the
    process has no FFN pool attachment."""


class FfnTimeout(FfnCallError):
    """An FfnAgent (or an attention TP follower) is alive but did not answer within the bound."""


class FfnPeerExited(FfnCallError):
    """An FfnAgent of the layer's execution group exited."""


class FfnFenced(FfnCallError):
    """The control plane fenced the mailbox: the generation failed or is stopping (the reason says which)."""


class FfnAgentFailed(FfnCallError):
    """An FfnAgent answered the call with an error (its message is the FfnAgent's)."""


class RankDisagreement(FfnCallError):
    """Attention TP ranks that share a mailbox made different calls: a protocol error of the engine side."""
