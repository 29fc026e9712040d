"""LiteLLM through the ledger: wrappers for the SDK, a callback for the proxy.

Needs the ``litellm`` extra (``pip install inflight-ledger[litellm]``);
``import inflight_ledger`` alone never imports LiteLLM.

**The SDK** (``LiteLLMCalls`` with a ``Ledger``, ``AsyncLiteLLMCalls`` with
an ``AsyncLedger``): each call begins a record, waits in line until its
lane admits it, calls ``litellm.completion``/``acompletion`` or
``embedding``/``aembedding``, and settles: a success with the answer's
model (refined when it differs) and token usage, an exception as a failure
(with the provider's ``Retry-After`` on a rate limit), a cancelled task or
a ``timeout`` as ``cancelled``. LiteLLM's own callbacks cannot hold a call
in line nor see a cancelled task, hence wrappers.

**The proxy** (``InflightCallback``, a LiteLLM ``CustomLogger``): its
``async_pre_call_hook`` begins the record and holds the request until the
lane admits it; the proxy's success and failure hooks settle it.

**What a call is recorded as.** The provider is LiteLLM's provider of the
model (``litellm.get_llm_provider``; on the proxy, that of the first
deployment of a model group too); the class is ``chat`` for completions
(and text completions, responses), ``embedding`` for embeddings; the model
is the begin's; ``max_tokens``, when the call passes it, is the begin's
``maxTokens``. The service, the priority and the class come from the
wrapper's or callback's settings, or from the call's ``metadata``, which
wins::

    metadata={"inflight_service": "assistant", "inflight_priority": "interactive", "inflight_class": "chat"}

**Trace context.** Each begin sends the OpenTelemetry span current where the
call is made (see the ledger's ``propagate_trace``); the SDK wrappers' calls
take ``traceparent=`` instead (never passed on to LiteLLM). The proxy's
callback, where no span is current, sends the ``traceparent`` header of the
request it serves, when that is well formed (W3C: a malformed one is
ignored), so the record's span joins the caller's trace.
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from datetime import datetime
from typing import Any, Dict, Mapping, MutableMapping, Optional, Tuple

import httpx
import litellm
import openai
from litellm.integrations.custom_logger import CustomLogger

from ._common import Usage, _header, checked_wait_step, retry_after_ms, retry_after_of, usage_of
from ._trace import current_traceparent, header_in, valid_traceparent
from .aio import AsyncActivity, AsyncLedger, _cancel_when_begun
from .errors import InflightError
from .sync import Activity, Ledger
from .wire import TRACEPARENT_HEADER, FailureStage

__all__ = [
    "ACTIVITY_KEY",
    "AsyncLiteLLMCalls",
    "CALL_CLASSES",
    "CLASS_KEY",
    "InflightCallback",
    "LiteLLMCalls",
    "PRIORITY_KEY",
    "SERVICE_KEY",
    "begin_spec",
    "failure_stage_of",
    "incoming_traceparent",
    "litellm_retry_after_ms",
]

#: The call's ``metadata`` keys that name its service, priority and class.
SERVICE_KEY = "inflight_service"
PRIORITY_KEY = "inflight_priority"
CLASS_KEY = "inflight_class"
#: Where the proxy callback notes the record's id in the request's metadata.
ACTIVITY_KEY = "inflight_activity_id"

#: ``InflightCallback``'s ``forget_after`` by default, in seconds.
FORGET_AFTER = 600.0
#: How often, at most, the callback looks its open records over.
_SWEEP_EVERY = 10.0
#: The wall clock the callback forgets records by (a test moves it).
_wall_clock = time.time

#: The class of each LiteLLM call type (the SDK's function names, the proxy's route types).
CALL_CLASSES: Mapping[str, str] = {
    "completion": "chat",
    "acompletion": "chat",
    "text_completion": "chat",
    "atext_completion": "chat",
    "responses": "chat",
    "aresponses": "chat",
    "embedding": "embedding",
    "aembedding": "embedding",
}


def _metadata(data: Mapping[str, Any]) -> Dict[str, Any]:
    """The call's metadata: ``metadata``, and the proxy's ``litellm_metadata``."""
    merged: Dict[str, Any] = {}
    for key in ("metadata", "litellm_metadata"):
        value = data.get(key)
        if isinstance(value, Mapping):
            merged.update(value)
    return merged


def _provider_of(model: str, data: Mapping[str, Any]) -> Tuple[str, str]:
    """``(model, provider)`` as LiteLLM resolves them: ``openai/gpt-4o`` is
    ``("gpt-4o", "openai")``."""
    resolved = litellm.get_llm_provider(
        model, custom_llm_provider=data.get("custom_llm_provider"), api_base=data.get("api_base")
    )
    return str(resolved[0]), str(resolved[1])


def begin_spec(
    call_type: str,
    data: Mapping[str, Any],
    *,
    service: Optional[str] = None,
    priority: Optional[str] = None,
    provider: Optional[str] = None,
) -> Dict[str, Any]:
    """The begin (wire names) of one LiteLLM call: ``data`` is the call's
    keyword arguments (the SDK) or the request (the proxy). ``service``,
    ``priority``: the defaults the call's metadata overrides; ``provider``:
    instead of LiteLLM's provider of the model. Raises ``ValueError`` when no
    service is named, LiteLLM's error when it knows no provider for the
    model."""
    meta = _metadata(data)
    chosen = meta.get(SERVICE_KEY) or service
    if not chosen:
        raise ValueError(
            f"inflight: no service for this LiteLLM call: pass service= or metadata={{{SERVICE_KEY!r}: ...}}"
        )
    model = data.get("model")
    spec: Dict[str, Any] = {"service": chosen}
    if isinstance(model, str) and model:
        if provider is None:
            model, provider = _provider_of(model, data)
        spec["model"] = model
    spec["provider"] = provider or "unknown"
    klass = meta.get(CLASS_KEY) or CALL_CLASSES.get(call_type)
    if klass:
        spec["class"] = klass
    chosen_priority = meta.get(PRIORITY_KEY) or priority
    if chosen_priority:
        spec["priority"] = chosen_priority
    max_tokens = data.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        spec["maxTokens"] = max_tokens
    return spec


def failure_stage_of(exc: BaseException) -> FailureStage:
    """``provider`` for an error of the provider's (LiteLLM raises its
    errors as the ``openai`` package's, ``httpx``'s when it did not map
    them), ``unknown`` for anything else (a bug, a bad argument)."""
    if isinstance(exc, (openai.APIError, httpx.HTTPError, TimeoutError)):
        return "provider"
    return "unknown"


class _Answer:
    """A status and headers, for ``retry_after_ms``."""

    def __init__(self, status_code: int, headers: Any) -> None:
        self.status_code = status_code
        self.headers = headers


def litellm_retry_after_ms(exc: BaseException) -> Optional[int]:
    """The provider's ``Retry-After`` (ms) a LiteLLM error carries: on its
    ``response`` (an ``httpx.Response``, kept by ``litellm.RateLimitError``),
    else on the headers LiteLLM attaches (``litellm_response_headers``,
    ``headers``) with the error's ``status_code`` (429 or 503)."""
    found = retry_after_of(exc)
    if found is not None:
        return found
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or isinstance(status, bool):
        return None
    for name in ("litellm_response_headers", "headers"):
        headers = getattr(exc, name, None)
        if headers is not None and _header(headers, "retry-after") is not None:
            ms = retry_after_ms(_Answer(status, headers))
            if ms is not None:
                return ms
    return None


def _answer_model(response: Any) -> Optional[str]:
    model = response.get("model") if isinstance(response, Mapping) else getattr(response, "model", None)
    return model if isinstance(model, str) and model else None


def _refined_model(record: Mapping[str, Any], response: Any) -> Optional[str]:
    """The answer's model when it differs from the record's."""
    model = _answer_model(response)
    return model if model is not None and model != record.get("model") else None


def _refuse_stream(kwargs: Mapping[str, Any]) -> None:
    if kwargs.get("stream"):
        raise ValueError(
            "inflight: the LiteLLM wrappers do not take stream=True (the call would run on after they return); "
            "wrap the stream in ledger.activity(...) and settle when it ends"
        )


def _warn_refine(err: InflightError) -> None:
    warnings.warn(f"inflight: the answer's model was not recorded: {err}", RuntimeWarning, stacklevel=3)


class _CallSettings:
    """What the SDK wrappers begin their calls with, sync or async alike."""

    def __init__(
        self,
        *,
        service: Optional[str] = None,
        priority: Optional[str] = None,
        provider: Optional[str] = None,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
    ) -> None:
        self.service = service
        self.priority = priority
        self.provider = provider
        self.max_wait = max_wait
        self.wait_step = checked_wait_step(wait_step)

    def spec(self, call_type: str, model: str, kwargs: Dict[str, Any]) -> Any:
        """The begin of a call of `call_type` with LiteLLM's `kwargs`."""
        _refuse_stream(kwargs)
        kwargs["model"] = model
        return begin_spec(call_type, kwargs, service=self.service, priority=self.priority, provider=self.provider)


class LiteLLMCalls(_CallSettings):
    """``litellm.completion`` and ``litellm.embedding`` through a ``Ledger``.

    ``service``, ``priority``: the calls' defaults (the call's ``metadata``
    wins, see the module's doc); ``provider``: instead of LiteLLM's provider
    of the model; ``max_wait``: seconds in line before ``WaitTimeoutError``
    (the record is cancelled, LiteLLM is not called)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        service: Optional[str] = None,
        priority: Optional[str] = None,
        provider: Optional[str] = None,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
    ) -> None:
        # Spelled out, not **kwargs: the signature is the API, typed.
        super().__init__(service=service, priority=priority, provider=provider, max_wait=max_wait, wait_step=wait_step)
        self.ledger = ledger

    def completion(self, model: str, *, traceparent: Optional[str] = None, **kwargs: Any) -> Any:
        """``litellm.completion(model, **kwargs)`` as one record; ``traceparent``:
        its begin's, instead of the current OpenTelemetry span's."""
        return self._call("completion", model, kwargs, traceparent)

    def embedding(self, model: str, *, traceparent: Optional[str] = None, **kwargs: Any) -> Any:
        """``litellm.embedding(model, **kwargs)`` as one record (see ``completion``)."""
        return self._call("embedding", model, kwargs, traceparent)

    def _call(self, call_type: str, model: str, kwargs: Dict[str, Any], traceparent: Optional[str]) -> Any:
        spec = self.spec(call_type, model, kwargs)
        fn = getattr(litellm, call_type)
        block = self.ledger.activity(spec, max_wait=self.max_wait, wait_step=self.wait_step, traceparent=traceparent)
        with block as call:
            try:
                response = fn(**kwargs)
            except Exception as exc:
                self._fail(call, exc)
                raise
            refined = _refined_model(call.record, response)
            if refined is not None:
                try:
                    call.refine(refined)
                except InflightError as err:
                    _warn_refine(err)
            call.report_usage_of(response)
        return response

    def _fail(self, call: Activity, exc: Exception) -> None:
        try:
            call.fail(failure_stage_of(exc), retry_after_ms=litellm_retry_after_ms(exc))
        except InflightError as err:
            self.ledger.on_ledger_error(err, call.record)


class AsyncLiteLLMCalls(_CallSettings):
    """``litellm.acompletion`` and ``litellm.aembedding`` through an
    ``AsyncLedger`` (see ``LiteLLMCalls``). ``timeout``: seconds for the
    wait in line and the call together; past it the record is cancelled
    (reason ``timeout``) and ``TimeoutError`` is raised. A cancelled task
    cancels the record, waiting or executing."""

    def __init__(
        self,
        ledger: AsyncLedger,
        *,
        service: Optional[str] = None,
        priority: Optional[str] = None,
        provider: Optional[str] = None,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        timeout: Optional[float] = None,
    ) -> None:
        super().__init__(service=service, priority=priority, provider=provider, max_wait=max_wait, wait_step=wait_step)
        self.ledger = ledger
        self.timeout = timeout

    async def acompletion(self, model: str, *, traceparent: Optional[str] = None, **kwargs: Any) -> Any:
        """``litellm.acompletion(model, **kwargs)`` as one record; ``traceparent``:
        its begin's, instead of the current OpenTelemetry span's."""
        return await self._call("acompletion", model, kwargs, traceparent)

    async def aembedding(self, model: str, *, traceparent: Optional[str] = None, **kwargs: Any) -> Any:
        """``litellm.aembedding(model, **kwargs)`` as one record (see ``acompletion``)."""
        return await self._call("aembedding", model, kwargs, traceparent)

    async def _call(self, call_type: str, model: str, kwargs: Dict[str, Any], traceparent: Optional[str]) -> Any:
        spec = self.spec(call_type, model, kwargs)
        fn = getattr(litellm, call_type)
        block = self.ledger.activity(
            spec, max_wait=self.max_wait, wait_step=self.wait_step, timeout=self.timeout, traceparent=traceparent
        )
        async with block as call:
            try:
                response = await fn(**kwargs)
            except Exception as exc:
                await self._fail(call, exc)
                raise
            refined = _refined_model(call.record, response)
            if refined is not None:
                try:
                    await call.refine(refined)
                except InflightError as err:
                    _warn_refine(err)
            call.report_usage_of(response)
        return response

    async def _fail(self, call: AsyncActivity, exc: Exception) -> None:
        try:
            await asyncio.shield(call.fail(failure_stage_of(exc), retry_after_ms=litellm_retry_after_ms(exc)))
        except InflightError as err:
            self.ledger.on_ledger_error(err, call.record)


def incoming_traceparent(data: Mapping[str, Any]) -> Optional[str]:
    """The ``traceparent`` header of the request the proxy serves (LiteLLM
    keeps its headers in ``data["proxy_server_request"]["headers"]``), when
    it is a well-formed version-00 one; ``None`` otherwise."""
    request = data.get("proxy_server_request")
    headers = request.get("headers") if isinstance(request, Mapping) else None
    return valid_traceparent(header_in(headers, TRACEPARENT_HEADER))


def _is_client_gone(exc: BaseException) -> bool:
    """The proxy's failure for a client that went away (an HTTP 499), or a cancellation."""
    return isinstance(exc, asyncio.CancelledError) or getattr(exc, "status_code", None) == 499


def _refusal(err: InflightError) -> Exception:
    """The ledger's refusal as the proxy answers it: a FastAPI
    ``HTTPException`` (429 for a wait that ran out or a full lane, else the
    ledger's status, 503 when it gave none) with the ledger's code and
    message; the ``InflightError`` itself where FastAPI is not installed."""
    try:
        from fastapi import HTTPException
    except ImportError:
        return err
    status = 429 if err.code in ("wait_timeout", "lane_full", "lane_cooling", "budget_exhausted") else err.status
    headers = None if err.retry_after is None else {"Retry-After": str(max(1, round(err.retry_after)))}
    detail = {"error": {"code": err.code, "message": str(err)}}
    refused: Exception = HTTPException(status_code=status or 503, detail=detail, headers=headers)
    return refused


class InflightCallback(CustomLogger, _CallSettings):  # type: ignore[misc]  # LiteLLM is not followed by mypy (see pyproject): CustomLogger is Any
    """The LiteLLM proxy's callback: each request the proxy serves (chat
    completions, embeddings, ...) is a record in the ledger.

    ``async_pre_call_hook`` begins the record and waits in line: the proxy
    holds the request until the lane admits it; past ``max_wait`` seconds
    (or when the ledger refuses it) the record is cancelled and the request
    is refused with the ledger's error (``HTTPException`` 429, code
    ``wait_timeout``). The record's id goes into the request's metadata
    (``inflight_activity_id``). The proxy's success hook (and, for a
    stream, the success event logged once it ended) settles a success with
    the answer's model and usage; its failure hook a failure (``provider``,
    with the ``Retry-After`` of a rate limit), or ``cancelled`` when the
    client went away.

    ``ledger``: an ``AsyncLedger`` (default: ``AsyncLedger()``, which reads
    ``INFLIGHT_URL``, ``INFLIGHT_TOKEN``, ``INFLIGHT_CA_FILE``); ``service``,
    ``priority``, ``provider``, ``max_wait``, ``wait_step``: as
    ``AsyncLiteLLMCalls``'s, the request's ``metadata`` overriding service,
    priority and class.

    ``forget_after``: how long, in seconds, a record no hook settled stays
    in ``open`` once the server has reaped it, or may (its ``reapedAt``,
    else its ``reapableAt``, as the server last answered): a hook that
    comes by then still settles it, as the late settle it is. After that it
    is forgotten, so that requests whose hooks never ran do not grow the
    proxy's memory without bound; the server keeps the evidence, the record
    reaped. Default 10 minutes; looked over at a request, at most every
    10 s.

    The begin sends the OpenTelemetry span current in the hook; where there
    is none, the served request's own ``traceparent`` header (when well
    formed: ``incoming_traceparent``). The ledger's ``propagate_trace=False``
    sends neither."""

    def __init__(
        self,
        ledger: Optional[AsyncLedger] = None,
        *,
        service: Optional[str] = None,
        priority: Optional[str] = None,
        provider: Optional[str] = None,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        forget_after: float = FORGET_AFTER,
    ) -> None:
        if isinstance(forget_after, bool) or not isinstance(forget_after, (int, float)) or not (
            math.isfinite(forget_after) and forget_after >= 0
        ):
            raise ValueError(f"forget_after must be a number of seconds, 0 or more; got {forget_after!r}")
        CustomLogger.__init__(self)
        # The settings are the SDK wrappers' own.
        _CallSettings.__init__(
            self, service=service, priority=priority, provider=provider, max_wait=max_wait, wait_step=wait_step
        )
        self.ledger = ledger if ledger is not None else AsyncLedger()
        #: The records begun and not yet settled, by id.
        self.open: Dict[str, AsyncActivity] = {}
        self.forget_after = float(forget_after)
        self._next_sweep = 0.0

    def _forget_past_their_time(self) -> None:
        """Forgets the open records the server reaped ``forget_after`` ago."""
        now = _wall_clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(self.forget_after, _SWEEP_EVERY)
        for activity_id, call in list(self.open.items()):
            if _reaped_by(call.record, now) + self.forget_after <= now:
                del self.open[activity_id]

    def _provider_for(self, data: Mapping[str, Any]) -> Optional[str]:
        """The provider to record: the setting, else LiteLLM's provider of
        the model, else (a model group of the proxy's router, which LiteLLM
        does not know by name) that of its first deployment."""
        if self.provider is not None:
            return self.provider
        model = data.get("model")
        if not isinstance(model, str) or not model:
            return None
        try:
            return _provider_of(model, data)[1]
        except Exception:  # noqa: BLE001 - not a model LiteLLM knows by name: try the router
            pass
        try:
            from litellm.proxy.proxy_server import llm_router
        except Exception:  # noqa: BLE001 - not running in the proxy
            return None
        if llm_router is None:
            return None
        for deployment in llm_router.get_model_list(model_name=model) or []:
            params = deployment.get("litellm_params") or {}
            try:
                return _provider_of(str(params.get("model")), params)[1]
            except Exception:  # noqa: BLE001
                return None
        return None

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: Dict[str, Any], call_type: str
    ) -> Optional[Dict[str, Any]]:
        self._forget_past_their_time()
        provider = self._provider_for(data)
        spec = begin_spec(call_type, data, service=self.service, priority=self.priority, provider=provider or "unknown")
        # The model is the name the client asked for (a model group, maybe); the answer's refines it.
        # The proxy's own span, if one is current, is the parent; else the caller's, from its header.
        traceparent = None
        if self.ledger.propagate_trace and current_traceparent() is None:
            traceparent = incoming_traceparent(data)
        # The begin is shielded: a cancellation meanwhile cancels the record once its id is known.
        begin = asyncio.ensure_future(self.ledger.begin(spec, traceparent=traceparent))
        try:
            call = await asyncio.shield(begin)
        except asyncio.CancelledError:
            begin.add_done_callback(_cancel_when_begun)
            raise
        except InflightError as err:
            raise _refusal(err) from err
        try:
            await call.admit(max_wait=self.max_wait, wait_step=self.wait_step)
        except BaseException as exc:
            cancel = asyncio.ensure_future(call.cancel("wait timeout" if isinstance(exc, InflightError) else "cancelled"))
            try:
                await asyncio.shield(cancel)
            except BaseException:  # noqa: BLE001 - a lost cancel is reaped past its bound
                pass
            if isinstance(exc, InflightError):
                raise _refusal(exc) from exc
            raise
        self.open[call.id] = call
        field = "litellm_metadata" if "litellm_metadata" in data else "metadata"
        meta = data.get(field)
        if not isinstance(meta, MutableMapping):
            meta = {} if meta is None else dict(meta)
            data[field] = meta
        meta[ACTIVITY_KEY] = call.id
        return data

    def _take(self, data: Optional[Mapping[str, Any]]) -> Optional[AsyncActivity]:
        if not data:
            return None
        meta = _metadata(data)
        nested = data.get("litellm_params")
        if not meta.get(ACTIVITY_KEY) and isinstance(nested, Mapping):
            meta = _metadata(nested)
        activity_id = meta.get(ACTIVITY_KEY)
        return self.open.pop(activity_id, None) if isinstance(activity_id, str) else None

    async def _succeed(self, call: AsyncActivity, response: Any) -> None:
        try:
            refined = _refined_model(call.record, response)
            if refined is not None:
                await call.refine(refined)
            usage: Optional[Usage] = usage_of(response)
            await call.succeed(usage=usage)
        except InflightError as err:
            self.ledger.on_ledger_error(err, call.record)

    async def async_post_call_success_hook(self, data: Dict[str, Any], user_api_key_dict: Any, response: Any) -> Any:
        call = self._take(data)
        if call is not None:
            await self._succeed(call, response)
        return None

    async def async_log_success_event(self, kwargs: Dict[str, Any], response_obj: Any, start_time: Any, end_time: Any) -> None:
        """A stream's success: the proxy's success hook does not see it end."""
        call = self._take(kwargs)
        if call is not None:
            await self._succeed(call, response_obj)

    async def async_post_call_failure_hook(
        self,
        request_data: Dict[str, Any],
        original_exception: BaseException,
        user_api_key_dict: Any,
        traceback_str: Optional[str] = None,
    ) -> Any:
        call = self._take(request_data)
        if call is None:
            return None
        try:
            if _is_client_gone(original_exception):
                await call.cancel("cancelled")
            else:
                await call.fail(
                    failure_stage_of(original_exception), retry_after_ms=litellm_retry_after_ms(original_exception)
                )
        except InflightError as err:
            self.ledger.on_ledger_error(err, call.record)
        return None


def _reaped_by(record: Mapping[str, Any], now: float) -> float:
    """When the server reaped ``record`` (``reapedAt``), else when it may
    (``reapableAt``), in seconds since the epoch; ``now`` when it says
    neither."""
    at = record.get("reapedAt") or record.get("reapableAt")
    if isinstance(at, str):
        try:
            # Python 3.9's fromisoformat reads no ``Z``.
            return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return now


_proxy_callback: Optional[InflightCallback] = None


def __getattr__(name: str) -> Any:
    """``inflight_ledger.litellm.proxy_callback``: an ``InflightCallback``
    made on first use, for a proxy's ``config.yaml``; its ledger reads
    ``INFLIGHT_URL`` and ``INFLIGHT_TOKEN``, its service
    ``INFLIGHT_LITELLM_SERVICE`` (else the requests' metadata names it)."""
    global _proxy_callback
    if name == "proxy_callback":
        if _proxy_callback is None:
            import os

            _proxy_callback = InflightCallback(service=os.environ.get("INFLIGHT_LITELLM_SERVICE") or None)
        return _proxy_callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
