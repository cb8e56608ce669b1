"""The daemon's own flags (the engine's are in server/engine/config.py); see server/settings.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvfork.server.settings import at_least, between, setting
from kvfork.server.generate.reasoning import REASONING_CHOICES
from kvfork.server.guard.limits import Limits
from kvfork.server.guard.tenants import read_keys_file
from kvfork.server.text.template import check_template
from kvfork.server.toolcalls import TOOL_PARSER_CHOICES

BACKENDS = ("auto", "mlx", "torch")
DTYPES = ("float32", "float16", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error")
IMAGE_CHOICES = ("replace", "refuse")


def _name_check(names: list[str]) -> str | None:
    bad = [n for n in names if not n.strip()]
    return "a served model name cannot be empty" if bad else None


def _key_check(keys: list[str]) -> str | None:
    bad = [k for k in keys if not k or k != k.strip() or len(k.split()) != 1]
    return "an API key cannot be empty or hold whitespace" if bad else None


def _header_check(names: list[str]) -> str | None:
    bad = [n for n in names if not n or any(c in n for c in " \t:()<>@,;\\\"/[]?={}") or not n.isascii()]
    return f"not a header name: {bad[0]!r}" if bad else None


def _origin_check(origins: list[str]) -> str | None:
    bad = [o for o in origins if o != "*" and (not o.startswith(("http://", "https://")) or
                                                "/" in o.split("://", 1)[1].rstrip("/"))]
    return f"an origin is scheme://host[:port] (or *), got {bad[0]!r}" if bad else None


def _host_name_check(names: list[str]) -> str | None:
    bad = [n for n in names if not n or any(c in n for c in " /:@")]
    return f"a host name holds no scheme, port or path, got {bad[0]!r}" if bad else None


def _zmq_address_check(address: str | None) -> str | None:
    if address is None:
        return None
    scheme, _, rest = address.partition("://")
    if scheme == "ipc" and rest:
        return None
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"expected tcp://HOST:PORT (or ipc://PATH), got {address!r}"
    return None


def _keys_file_check(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        read_keys_file(path)
    except ValueError as e:
        return str(e)
    return None


def _template_check(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return check_template(f.read())
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read {path}: {e}"


@dataclass(frozen=True)
class ServerConfig(Limits):
    """The daemon's flags; every limit on a request (server/guard/limits.py) is one of them too."""

    SETTINGS_GROUP = "serving"

    model: list[str] = setting([], "model folder (Hugging Face layout), hub id, .gguf file or org/name:file.gguf, "
                               "optionally named NAME=PATH; repeat to serve several, picked by the request's model "
                               "(docs/models.md); default: SmolLM2, converted and fetched by `kvfork fetch-model` on "
                               "first run", repeat=True, group="model and device")
    models_dir: str | None = setting(None, "serve every model folder (or hub cache entry) in this folder, each by "
                                     "its folder's name", group="model and device")
    pin: list[str] = setting([], "a model name never unloaded to make room for another; repeat for more",
                             repeat=True, group="model and device")
    max_loaded_models: int = setting(0, "most models loaded at once (0: as many as --memory-budget-bytes holds; "
                                     "the MLX backend loads one at a time)", check=at_least(0),
                                     group="model and device")
    model_ttl: float = setting(0.0, "seconds an idle model stays loaded when several are served (0: until "
                               "another needs its memory)", check=at_least(0), group="model and device")
    memory_budget_bytes: int | None = setting(None, "device bytes the weights and KV of every loaded model share "
                                              "when several are served (default: the device's rule, "
                                              "docs/kv-budget.md)", size=True, check=at_least(1),
                                              group="model and device")
    model_switch_timeout: float = setting(30.0, "seconds the requests running on a model get to finish before it "
                                          "unloads for another (the rest end with an error naming the switch)",
                                          check=at_least(0), group="model and device")
    model_switch_interval: float = setting(30.0, "seconds between two switches one tenant causes that unload a "
                                           "model another tenant used (its request waits meanwhile; 0: no limit)",
                                           check=at_least(0), group="model and device")
    backend: str = setting("auto", "auto: MLX on Apple Silicon, torch elsewhere (CUDA when present, else the CPU; "
                           "MLX where the torch backend is not installed)",
                           choices=BACKENDS, group="model and device")
    dtype: str | None = setting(None, "weights and KV dtype (default: float32 on the CPU, bf16/fp16 on a GPU)",
                                choices=DTYPES, group="model and device")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8080, "port to listen on (0: any free port)", check=between(0, 65535))
    allowed_origins: list[str] = setting([], "a web page origin (https://app.example.com; * for any) that may "
                                         "call the daemon from a browser (CORS): pages of other sites are refused "
                                         "a 403; repeat for more", repeat=True, check=_origin_check)
    allowed_hosts: list[str] = setting([], "a name clients reach the daemon by (its Host header), besides loopback "
                                       "names, IP addresses and this machine's name (* for any; guards against "
                                       "DNS rebinding); repeat for more", repeat=True, check=_host_name_check)
    api_key: list[str] = setting([], "require a key (Authorization: Bearer KEY, or x-api-key) on every /v1 route; "
                                 "repeat for more, each its own tenant: nothing one tenant computed is reused for "
                                 "another (prefer KVFORK_API_KEY, --api-keys-file or --config: a command line is "
                                 "readable by every local user)", repeat=True, check=_key_check, secret=True)
    api_keys_file: str | None = setting(None, "file of accepted keys, one `KEY TENANT` per line (# comments); "
                                        "keys of one tenant share its cached state, other tenants never do",
                                        check=_keys_file_check)
    served_model_name: list[str] = setting([], "a name clients may use for the model; repeat for more "
                                           "(default: the model folder's name)", repeat=True, check=_name_check)
    accept_any_model: bool = setting(False, "serve requests whatever model name they send (for agents that send "
                                     "their own)")
    prefix_cache_warm: str | None = setting(None, "JSON file of chat prompts computed at start, each a messages "
                                            "list or {\"messages\": [...], \"tenant\": NAME} (docs/serving.md: "
                                            "Prefix cache on disk)", group="reuse")
    sse_keepalive: float = setting(5.0, "seconds of silence (a long prefill, a queue wait) before a stream sends a "
                                   "keep-alive comment", check=at_least(0.01))
    shutdown_grace: float = setting(10.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM",
                                    check=at_least(0))
    log_level: str = setting("info", "log verbosity", choices=LOG_LEVELS)
    tool_parser: str = setting("auto", "tool-call format to parse from replies (auto: the one the chat template "
                               "teaches; none: never parse)", choices=TOOL_PARSER_CHOICES)
    session_header: list[str] = setting([], "a client header whose value names a kvfork session, as X-Kvfork-Session "
                                        "does (e.g. x-session-id); repeat for more. Sessions are opt-in: without it "
                                        "only X-Kvfork-Session and the body's session_id open one",
                                        repeat=True, check=_header_check)
    distributed: bool = setting(False, "one model split over ranks (tensor parallel): run this on every rank, "
                                "under mlx.launch or torchrun (or with their environment set by hand); rank 0 "
                                "serves HTTP and runs the engine, the others apply its steps to their shards",
                                group="model and device")
    rank_timeout: float = setting(120.0, "--distributed: seconds a step may wait on the other ranks before rank 0 "
                                  "declares them failed and answers 503", check=at_least(1),
                                  group="model and device")
    # An event carries token ids: the example binds loopback, and nothing is published unless asked for.
    kv_events_endpoint: str | None = setting(None, "publish KV events in vLLM's format (ZMQ PUB) on this address, "
                                             "e.g. tcp://127.0.0.1:5557 (events carry token ids: bind beyond "
                                             "loopback only behind a firewall); off by default",
                                             check=_zmq_address_check)
    kv_events_replay_endpoint: str | None = setting(None, "ZMQ ROUTER address that replays missed KV event "
                                                    "batches (default: the endpoint's port + 1)",
                                                    check=_zmq_address_check)
    kv_events_format: str = setting("map", "KV events' msgpack encoding: map (vLLM's today, what vllm-router "
                                    "reads) or array (vLLM's earlier [ts, events, dp_rank] arrays)",
                                    choices=("map", "array"))
    kv_events_block_size: int = setting(16, "tokens per block in KV events: the block size the router is told "
                                        "(vllm-router's --kv-event-block-size, 16 by default)", check=at_least(1))
    kv_events_public: bool = setting(False, "with API keys: publish KV events, which carry every tenant's prompt "
                                     "token ids, to whoever can reach --kv-events-endpoint (without it a keyed "
                                     "daemon publishes only on ipc:// in a private folder, or hashes only)")
    kv_events_hashes_only: bool = setting(False, "KV events carry block hashes only: no token ids, no scope keys "
                                          "(for routers that take the hashes as published; vllm-router's "
                                          "kv_aware recomputes them from token ids and needs those)")
    reasoning_parser: str = setting("auto", "split reasoning from content: <think> (think), [THINK] (mistral), "
                                    "Gemma 4's, LongCat's, Kimi K3's markers or gpt-oss's Harmony channels (auto: "
                                    "the ones the chat template uses)", choices=REASONING_CHOICES)
    images: str = setting("replace", "what a text-only model does with an image inside a tool result (an agent "
                          "reading a screenshot): replace it by one line of text naming its media type and size, "
                          "so the session goes on, or refuse the request with a 400 as it refuses an image in a "
                          "user's message", choices=IMAGE_CHOICES)
    allowed_media_domains: list[str] = setting([], "a host an image's http(s) URL may name (vLLM's flag); without "
                                               "one every such URL is a 400 and images come as data URLs. A "
                                               "text-only model fetches none; repeat for more", repeat=True,
                                               check=_host_name_check)
    chat_template: str | None = setting(None, "a Jinja chat template file to use instead of the model's (clients "
                                        "can never send one)", check=_template_check)
    log_stats: bool = setting(True, "log a stats line every 10 s while busy: throughput, running and waiting "
                              "requests, KV in use, prefix cache hit rate in tokens (vLLM's --disable-log-stats "
                              "is --no-log-stats)")
    access_log: bool = setting(True, "log a line per HTTP request: client, request line, status, bytes, seconds "
                               "(--no-access-log: off)")
    keep_volatile_lines: bool = setting(False, "keep the volatile lines clients put in prompts (Claude Code's "
                                        "billing line: server/api/volatile.py), which otherwise are taken out "
                                        "before rendering so they never cost a prefill")
    refusal_rate: float = setting(10.0, "4xx answers per second a tenant may draw (an authentication failure, or "
                                  "any request to a daemon without keys: its client address), in bursts of 10 "
                                  "seconds' worth; past it, its requests wait a second and get a 429",
                                  check=at_least(0.01))
    metrics_key: str | None = setting(None, "require this key (Authorization: Bearer KEY) on /metrics, which is "
                                      "open otherwise; tenants' API keys do not open it (prefer KVFORK_METRICS_KEY "
                                      "or --config)",
                                      check=lambda k: _key_check([k]) if k is not None else None, secret=True)
