"""kelastic's etcd v3 client, shared by the sidecar and the operator.

It wraps the gRPC stubs that ``etcd-sdk-python`` (``pyetcd``) generates from etcd's
protobufs, not pyetcd's high-level client, whose failover marks an endpoint dead for
300 s after one failed call and whose shared watch thread outlives the calls that use
it. Every call here has one deadline (retries included) and each one-off wait opens its
own watch stream and closes it before returning.

Modules, by concern (none imports another's private names):

- :mod:`.errors`: what to do about a failure (:class:`EtcdUnavailable`: retry;
  :class:`EtcdRefused`: surface; :class:`EtcdLeaseNotFound`: re-join);
- :mod:`.call`: channels, TLS, deadline, failover, the back-off helper, error
  classification; :mod:`.auth`: etcd's user/password tokens;
- :mod:`.kv`: reads, writes, compare-and-set transactions;
- :mod:`.lease`: leases and their keep-alive;
- :mod:`.watch`: one-off waits; :mod:`.watcher`: a long-lived watch stream;
- :mod:`.client`: :class:`EtcdClient`, all of the above.

Layering: imports neither the sidecar nor the operator (an import-linter contract);
the worker library ``kelastic`` does not import it (it stays stdlib-only).
"""

from .call import DEFAULT_PORT, Backoff
from .client import EtcdClient
from .errors import EtcdError, EtcdLeaseNotFound, EtcdRefused, EtcdUnavailable
from .kv import Snapshot
from .lease import Lease
from .watcher import Watcher

__all__ = [
    "DEFAULT_PORT",
    "Backoff",
    "EtcdClient",
    "EtcdError",
    "EtcdLeaseNotFound",
    "EtcdRefused",
    "EtcdUnavailable",
    "Lease",
    "Snapshot",
    "Watcher",
]
