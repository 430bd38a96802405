"""P2P section of the config tree (owned by node/p2p). Only pydantic here: imported at start-up."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class P2PConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(0, ge=0, le=65535)
    max_concurrent_streams: int = Field(8, ge=1)
