"""Run one API-format prompt on a live ComfyUI and report what happened, as JSON on stdout.

    python run_prompt.py http://127.0.0.1:PORT prompt.json [--interrupt-after N]

Listens on the WebSocket for progress messages, optionally POSTs /interrupt after the N-th
progress message, and polls /history until the prompt finished. It reads the socket until its own
end-of-prompt message (or 5 s after /history says finished), so that no progress message is lost. Needs aiohttp (the ComfyUI venv
has it). Bounded: gives up after 300 s.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import aiohttp


async def main(base: str, prompt_path: str, interrupt_after: int | None) -> dict:
    prompt = json.load(open(prompt_path))
    client_id = uuid.uuid4().hex
    report = {"progress": [], "executed": [], "status": None, "messages": [], "outputs": {}}
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(f"{base.replace('http', 'ws')}/ws?clientId={client_id}")
        r = await s.post(f"{base}/prompt", json={"prompt": prompt, "client_id": client_id})
        body = await r.json()
        if r.status != 200 or body.get("node_errors"):
            report["status"] = "rejected"
            report["error"] = body
            return report
        pid = body["prompt_id"]
        deadline = time.time() + 300
        interrupted = False
        ws_done = False                      # the socket said the prompt ended
        finished = None                      # when /history first said so
        polled = 0.0
        while time.time() < deadline:
            try:
                msg = await ws.receive(timeout=1.0)
            except asyncio.TimeoutError:
                msg = None
            if msg is not None and msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                                aiohttp.WSMsgType.ERROR):
                ws_done, msg = True, None        # the socket is gone: /history alone says when it ended
                await asyncio.sleep(0.2)
            if msg is not None and msg.type == aiohttp.WSMsgType.TEXT:
                data = json.loads(msg.data)
                if data.get("type") == "progress" and data["data"].get("prompt_id") == pid:
                    report["progress"].append([data["data"]["node"], data["data"]["value"], data["data"]["max"]])
                    if interrupt_after and len(report["progress"]) >= interrupt_after and not interrupted:
                        await s.post(f"{base}/interrupt")
                        interrupted = True
                elif data.get("type") == "executed" and data["data"].get("prompt_id") == pid:
                    report["executed"].append(data["data"]["node"])
                elif (data.get("data") or {}).get("prompt_id") == pid and (
                        data.get("type") in ("execution_success", "execution_error", "execution_interrupted")
                        or (data.get("type") == "executing" and data["data"].get("node") is None)):
                    ws_done = True
            if not ws_done and msg is not None and time.time() - polled < 0.5:
                continue                     # read the socket first: history can finish before it is read
            polled = time.time()
            h = await (await s.get(f"{base}/history/{pid}")).json()
            if pid in h and h[pid].get("status", {}).get("completed") is not None:
                st = h[pid]["status"]
                finished = finished or time.time()
                if not ws_done and time.time() - finished < 5.0:
                    continue                 # the socket's last messages may still be on their way
                if st.get("status_str") in ("success", "error"):
                    report["status"] = st["status_str"]
                    report["messages"] = [m[0] for m in st.get("messages", [])]
                    report["error_messages"] = [m[1] for m in st.get("messages", []) if m[0] == "execution_error"]
                    report["outputs"] = h[pid].get("outputs", {})
                    break
        await ws.close()
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    n = None
    if "--interrupt-after" in args:
        i = args.index("--interrupt-after")
        n = int(args[i + 1])
        del args[i:i + 2]
    print(json.dumps(asyncio.run(main(args[0], args[1], n))))
