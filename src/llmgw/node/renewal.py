"""A node renews its own certificate before it runs out (issue 36; security/pki.py).

At `pki.RENEW_AT` (two thirds) of the current certificate's life, the node worker makes a new key (it never
leaves the node), sends a CSR for it to the node API over the current certificate (`POST /node/v1/renew`),
installs the certificate that comes back with the key (`pki.install_renewed`: each file replaced
atomically, a crash in between completed at the next start) and presents it on every new connection. A
renewal that fails is retried, sooner as the end nears; one that is refused (the certificate is revoked) is
logged as an error and retried all the same, in case an operator lets the node back.

The file is read again before every wait: an operator who copies a new certificate in (after
`llmgw ctl cert node NODE --force`) is renewed from that one, and a restart picks it up.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import TYPE_CHECKING

import aiohttp

from llmgw.node.errors import ReportRefused
from llmgw.schemas.api import RenewRequest, RenewResponse
from llmgw.security.pki import install_renewed, load_cert, make_csr, renew_after

if TYPE_CHECKING:
    from llmgw.node.agent import Agent

log = logging.getLogger(__name__)

LONGEST_WAIT_S = 3600.0  # the certificate file is looked at again at least this often


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


async def renew(agent: "Agent") -> RenewResponse:
    """Renew once: a new key here, a CSR to the node API, the answer installed and used for new connections.
    Raises `ReportRefused` when the node API refuses (revoked, a CSR it will not sign), and the transport's
    errors when it cannot be reached."""
    s = agent.settings
    key, csr = await asyncio.to_thread(make_csr, agent.node_id)
    resp = RenewResponse.model_validate(await agent._post("/node/v1/renew", RenewRequest(node_id=agent.node_id, csr=csr)))
    await asyncio.to_thread(install_renewed, s.node_cert, s.node_key, resp.certificate, key)
    await agent.use_new_certificate()
    log.info("renewed this node's certificate: serial %s, valid until %s", resp.serial,
             resp.not_after.isoformat(timespec="seconds"))
    return resp


async def renew_loop(agent: "Agent") -> None:
    """Renew the node's certificate at two thirds of its life, for as long as the worker runs."""
    s = agent.settings
    while True:
        try:
            cert = await asyncio.to_thread(load_cert, s.node_cert)
        except (OSError, ValueError) as exc:
            log.error("cannot read this node's certificate %s (%s); trying again in a minute", s.node_cert, exc)
            await asyncio.sleep(60)
            continue
        now = _now()
        left = (cert.not_valid_after_utc - now).total_seconds()
        wait = (renew_after(cert) - now).total_seconds()
        if wait > 0:
            await asyncio.sleep(min(wait, LONGEST_WAIT_S))
            continue
        if left <= 0:
            log.error("this node's certificate ran out at %s: it can no longer reach the node API, nor renew. Issue "
                      "a new one (llmgw ctl cert node %s --force) and copy it to %s",
                      cert.not_valid_after_utc.isoformat(timespec="seconds"), agent.node_id, s.node_cert)
            await asyncio.sleep(60)
            continue
        retry_s = max(1.0, min(60.0, left / 20))
        try:
            await renew(agent)
            continue
        except ReportRefused as exc:
            log.error("the node API refused to renew this node's certificate (%s); it runs out at %s", exc,
                      cert.not_valid_after_utc.isoformat(timespec="seconds"))
        except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as exc:  # (before OSError: ClientOSError is one)
            log.warning("renewing this node's certificate failed (%s); retrying in %.0fs", exc, retry_s)
        except OSError as exc:  # the renewed files could not be written (a read-only directory, a full disk)
            log.error("could not install this node's renewed certificate at %s (%s); it runs out at %s",
                      s.node_cert, exc, cert.not_valid_after_utc.isoformat(timespec="seconds"))
        except Exception:  # noqa: BLE001 - this loop ending would end the worker: logged with its traceback
            log.exception("renewing this node's certificate failed; retrying in %.0fs", retry_s)
        await asyncio.sleep(retry_s)
