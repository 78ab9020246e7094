#!/usr/bin/env bash
# The engine's folders include one way (docs/design-notes.md, "The engine's folders"):
# a file may include its own folder and the folders after it in ORDER, never one
# before. Fails naming every file that includes upward.
set -euo pipefail
root=${1:?usage: check_layering.sh SOURCE_DIR}
ORDER=(cli interop testing train pipeline model runtime plugins manifest topology text files)
status=0
for i in "${!ORDER[@]}"; do
  folder=${ORDER[$i]}
  allowed=" ${ORDER[*]:$i} "
  [ -d "$root/engine/$folder" ] || { echo "no folder engine/$folder (update ORDER)"; status=1; continue; }
  while IFS=: read -r file included; do
    target=${included#engine/}
    target=${target%%/*}
    if [[ "$allowed" != *" $target "* ]]; then
      echo "${file#$root/}: includes engine/$target from engine/$folder (only: $allowed)"
      status=1
    fi
  done < <(grep -oHE '#include "engine/[a-z_]+/' "$root/engine/$folder"/*.?pp | sed 's|#include "||')
done
# Every folder of engine/ is in ORDER.
for d in "$root"/engine/*/; do
  name=$(basename "$d")
  [[ " ${ORDER[*]} " == *" $name "* ]] || { echo "engine/$name is not in the layering order"; status=1; }
done
[ $status -eq 0 ] && echo "layering: every include points down the order (${ORDER[*]})"
exit $status
