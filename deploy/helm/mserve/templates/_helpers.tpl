{{- define "mserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mserve.labels" -}}
{{ include "mserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "mserve.image" -}}
{{- $variant := ternary "cuda" "cpu" (gt (int .Values.gpu.count) 0) -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag) -}}
{{- end -}}

{{/* The Secret holding key_file.json: the user's, the chart's, or none (random keys). */}}
{{- define "mserve.keySecret" -}}
{{- if .Values.auth.enabled -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if or .Values.auth.keys.inference .Values.auth.keys.management -}}
{{- printf "%s-keys" (include "mserve.fullname" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* SIGTERM comes after preStop; mserve then drains for up to shutdown_drain_s and gives
     workers as long again to exit. */}}
{{- define "mserve.gracePeriod" -}}
{{- add (int .Values.shutdown.preStopSleepSeconds) (mul 2 (int .Values.shutdown.drainSeconds)) (int .Values.shutdown.marginSeconds) -}}
{{- end -}}

{{/* mserve.yaml: the chart's keys, then the user's config (which may not set the chart's). */}}
{{- define "mserve.config" -}}
{{- $own := dict
  "inference_address" (printf "0.0.0.0:%d" (int .Values.ports.http))
  "management_address" (printf "%s:%d" (ternary "0.0.0.0" "127.0.0.1" .Values.exposeManagement) (int .Values.ports.management))
  "metrics_address" (printf "0.0.0.0:%d" (int .Values.ports.metrics))
  "grpc_inference_address" (printf "0.0.0.0:%d" (int .Values.ports.grpc))
  "grpc_management_address" "127.0.0.1:7071"
  "model_store" "/models"
  "run_dir" "/var/lib/mserve"
  "load_models" .Values.models
  "shutdown_drain_s" (int .Values.shutdown.drainSeconds)
  "number_of_gpu" (int .Values.gpu.count)
  "enable_model_api" .Values.enableModelApi
  "disable_token_authorization" (not .Values.auth.enabled)
-}}
{{- if include "mserve.keySecret" . -}}
{{- $_ := set $own "token_key_file" "/etc/mserve-keys/key_file.json" -}}
{{- end -}}
{{- range $key, $_ := .Values.config -}}
{{- if hasKey $own $key -}}
{{- fail (printf "config.%s is set by the chart; use its own value (docs/kubernetes.md)" $key) -}}
{{- end -}}
{{- end -}}
{{- toYaml (merge (deepCopy .Values.config) $own) -}}
{{- end -}}
