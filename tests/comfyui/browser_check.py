"""Load every workflow into the real ComfyUI frontend in headless Chromium; report errors and
optionally save a screenshot of each as its thumbnail.

    python browser_check.py http://127.0.0.1:PORT OUT_DIR workflow.json [...]

Chromium is driven over the DevTools protocol with aiohttp (no browser-driver package needed).
For each workflow: ``app.loadGraphData(workflow)``, then the graph must hold every node, each node
type must be registered in the frontend (so the pack's nodes arrived through /object_info), and
no page exception or console error may occur. Prints a JSON report. Bounded: 240 s in all.
"""
from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1600,1000", "--hide-scrollbars"]


# warning / error toasts and dialogs the frontend shows (schema errors, missing nodes or models)
ALERTS = """(() => Array.from(document.querySelectorAll(
  '.p-toast-message-warn, .p-toast-message-error, .p-dialog'))
  .map(e => e.innerText.trim()).filter(t => t))()"""
DISMISS = """(() => { document.querySelectorAll('.p-dialog-close-button, .p-toast-close-button')
  .forEach(b => b.click()); return true; })()"""
FIT = """;(() => { try { app.canvas.ds.scale = 0.8; app.canvas.ds.offset = [60, 150];
  app.canvas.setDirty(true, true); } catch (e) {} return true; })()"""
# resolves after the page has drawn two more frames: what was set before is on the canvas
FRAMES = "new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDP:
    """The few DevTools-protocol calls the check needs, over one page's WebSocket."""

    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, **params):
        self.next_id += 1
        mid = self.next_id
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def evaluate(self, expression: str):
        res = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS error: {res['exceptionDetails'].get('exception', {}).get('description')}")
        return res["result"].get("value")

    async def pump(self, seconds: float):
        end = time.time() + seconds
        while time.time() < end:
            try:
                self.events.append(await self.ws.receive_json(timeout=0.2))
            except asyncio.TimeoutError:
                pass


def _errors(events) -> list[str]:
    out = []
    for e in events:
        if e.get("method") == "Runtime.exceptionThrown":
            out.append(e["params"]["exceptionDetails"].get("exception", {}).get("description", "exception"))
        elif e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
            out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"]))
    return out


async def run(url: str, out_dir: Path, workflows: list[Path]) -> dict:
    import aiohttp                      # in the ComfyUI venv; find_chromium() must import without it

    chromium = find_chromium()
    if chromium is None:
        return {"error": "chromium not found (Debian: apt-get install chromium)"}
    profile = tempfile.mkdtemp()
    proc = subprocess.Popen([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    report = {"workflows": {}}
    try:
        port = None
        deadline = time.time() + 60
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            if "DevTools listening on ws://" in line:
                port = int(line.split("ws://")[1].split("/")[0].split(":")[1])
        if port is None:
            return {"error": "chromium did not start"}
        async with aiohttp.ClientSession() as s:
            targets = await (await s.get(f"http://127.0.0.1:{port}/json")).json()
            page = next(t for t in targets if t["type"] == "page")
            async with s.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                cdp = CDP(ws)
                for domain in ("Page", "Runtime", "Log"):
                    await cdp.call(f"{domain}.enable")
                # no first-run template gallery over the canvas
                await s.post(f"{url}/settings/Comfy.TutorialCompleted", json=True)
                await cdp.call("Page.navigate", url=url)
                for _ in range(120):
                    if await cdp.evaluate("!!(window.app && window.app.graph && window.LiteGraph)"):
                        break
                    await cdp.pump(0.5)
                else:
                    return {"error": "the frontend did not come up", "page_errors": _errors(cdp.events)}
                await cdp.pump(2.0)
                report["startup_errors"] = _errors(cdp.events)
                for path in workflows:
                    cdp.events.clear()
                    wf = json.loads(path.read_text())
                    await cdp.evaluate(DISMISS)
                    await cdp.evaluate(f"app.loadGraphData({json.dumps(wf)})")
                    await cdp.evaluate(FRAMES)
                    await cdp.pump(0.5)                          # late toasts and console errors
                    alerts = await cdp.evaluate(ALERTS)          # toasts are not console errors
                    await cdp.evaluate(DISMISS + FIT)
                    await cdp.evaluate(FRAMES)
                    await cdp.pump(0.2)
                    state = await cdp.evaluate(
                        "JSON.stringify({n: app.graph._nodes.length, types: app.graph._nodes.map(n => n.type),"
                        " unknown: app.graph._nodes.filter(n => !LiteGraph.registered_node_types[n.type])"
                        ".map(n => n.type)})")
                    state = json.loads(state)
                    shot = await cdp.call("Page.captureScreenshot", format="png",
                                          clip={"x": 0, "y": 0, "width": 1600, "height": 1000, "scale": 0.75})
                    png = out_dir / (path.stem + ".png")
                    png.write_bytes(base64.b64decode(shot["data"]))
                    report["workflows"][path.name] = {"nodes": state["n"], "expected_nodes": len(wf["nodes"]),
                                                      "unknown_types": state["unknown"],
                                                      "errors": _errors(cdp.events) + alerts,
                                                      "screenshot": str(png)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
    return report


if __name__ == "__main__":
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(asyncio.wait_for(run(sys.argv[1], out, [Path(p) for p in sys.argv[3:]]), 240))))
