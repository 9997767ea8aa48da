"""`POST /admin/v1/codec/decode`: Temporal's codec-server protocol on the admin listener, so an operator
reads encrypted payloads (security/payload_codec.py) in plain text: `temporal workflow show --workflow-id ID
--codec-endpoint http://ADMIN/admin/v1/codec --codec-auth "Bearer $LLMGW_ADMIN_TOKEN"`, or a Temporal web UI
given the endpoint behind a proxy that adds the token. Decode only: no llmgw workflow is started or
signalled by hand, and an encode endpoint would let a token holder forge nothing it cannot already do.

The body is Temporal's JSON of `Payloads` (`{"payloads": [{"metadata": {...base64}, "data": base64}]}`),
bounded by the admin listener's body limit and `MAX_PAYLOADS`; anything else is a 400 saying what to send."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from llmgw.http import errors
from llmgw.http.errors import APIError
from llmgw.security.payload_codec import EncryptionCodec, PayloadKeyError

MAX_PAYLOADS = 1000
SHAPE = 'send Temporal\'s JSON of Payloads: {"payloads": [{"metadata": {"encoding": "<base64>"}, "data": "<base64>"}]}'


def mount_codec(app: FastAPI, codec: EncryptionCodec | None) -> None:
    @app.post("/admin/v1/codec/decode")
    async def decode(request: Request):
        if codec is None:
            raise APIError(404, "this control plane has no payload key (LLMGW_PAYLOAD_KEY): its payloads are "
                           "not encrypted, and Temporal shows them as they are", code="no_payload_key")
        body = await request.body()
        try:
            payloads = json_format.Parse(body.decode("utf-8"), Payloads(), ignore_unknown_fields=False)
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
            raise errors.bad_request(f"the body is no Payloads ({str(exc)[:200]}): {SHAPE}", param="payloads") \
                from None
        if len(payloads.payloads) > MAX_PAYLOADS:
            raise errors.bad_request(f"{len(payloads.payloads)} payloads; at most {MAX_PAYLOADS} a request",
                                     param="payloads")
        try:
            out = Payloads(payloads=[codec.decode_one(p) for p in payloads.payloads])
        except PayloadKeyError as exc:
            raise errors.bad_request(str(exc), param="payloads") from None
        return JSONResponse(json_format.MessageToDict(out))
