"""Typed reads of request body fields, each refusing a wrong value with a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any

from services.rollout.agent.errors import bad_request


def text(content: Any, where: str) -> str:
    """Message content as text: a string, null, or a list of text parts (`text`/`input_text`/`output_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise bad_request(f"{where}[{i}]: only text content parts are supported, got {short(part)}", where)
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}", where)


def short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def args_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def number(body: dict[str, Any], name: str, kind: type, low: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad_request(f"{name} must be {'an integer' if kind is int else 'a number'}, got {short(value)}", name)
    if low is not None and value < low:
        raise bad_request(f"{name} must be >= {low}, got {value}", name)
    return kind(value)


def stop(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"{name} must be a string or a list of non-empty strings", name)
    return list(stops)


def penalty(body: dict[str, Any], name: str) -> float:
    """`frequency_penalty` / `presence_penalty`: a number in [-2, 2] (OpenAI's and SGLang's range)."""
    value = number(body, name, float, -2.0) or 0.0
    if value > 2.0:
        raise bad_request(f"{name} must be in [-2, 2], got {value}", name)
    return float(value)


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI `logit_bias`: token id (as a string) -> bias in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request(f"logit_bias must be an object of token id -> bias, got {short(raw)}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not str(key).lstrip("-").isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > 100:
            raise bad_request(f"logit_bias entries must be token id -> a number in [-100, 100], got {short({key: value})}", "logit_bias")
        out[int(key)] = float(value)
    return out


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {short(value)}", name)
    return bool(value)


def top_logprobs(body: dict[str, Any], logprobs: bool) -> int:
    top = number(body, "top_logprobs", int, 0) or 0
    if top > 20:
        raise bad_request(f"top_logprobs must be <= 20, got {top}", "top_logprobs")
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return int(top)


def body_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling options chat and text completions read alike (temperature, top_p, stop, seed,
    the penalties, logit_bias), checked, as `ParsedRequest` keywords."""
    return {
        "temperature": number(body, "temperature", float, 0),
        "top_p": number(body, "top_p", float, 0),
        "stop": stop(body.get("stop"), "stop"),
        "seed": number(body, "seed", int),
        "frequency_penalty": penalty(body, "frequency_penalty"),
        "presence_penalty": penalty(body, "presence_penalty"),
        "logit_bias": logit_bias(body),
    }
