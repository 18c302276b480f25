"""Model patches: route packed cu_seqlens to varlen attention."""
