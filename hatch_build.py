"""Ship the start-up hook that registers `bmm` for stock mergekit commands.

A `.pth` file in site-packages runs at interpreter start-up; ours imports the tiny
`mergekit_bmm_autoload` module, which registers the plugin's methods the moment
`mergekit.merge_methods` is imported. Hatchling needs a hook to put the file in
both regular and editable wheels.
"""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH_SOURCE = "mergekit_bmm_autoload.pth"


class AutoloadPthHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data.setdefault(key, {})[PTH_SOURCE] = PTH_SOURCE
